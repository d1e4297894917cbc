"""The character tokenizer and Hugging Face tokenizer.json loading, behind one interface."""

import json

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from streamrl_jax.models import CharTokenizer, Tokenizer, load_tokenizer
from streamrl_jax.models.tokenizer import CHAR_ALPHABET


@given(st.text(alphabet=CHAR_ALPHABET, max_size=40))
def test_char_tokenizer_round_trip(text):
  tok = CharTokenizer()
  ids = tok.encode(text)
  assert len(ids) == len(text) and all(3 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids + [tok.eos_id] + tok.encode("junk")) == text


def test_char_tokenizer_rejects_unknown_character():
  with pytest.raises(ValueError, match="'€'"):
    CharTokenizer().encode("12€")


def _write_word_level(directory, with_config=True):
  vocab = {"<pad>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.decoder = tokenizers.decoders.WordPiece()
  tok.add_special_tokens(["<pad>", "</s>"])
  tok.save(str(directory / "tokenizer.json"))
  if with_config:
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))


def test_load_tokenizer_reads_specials_and_round_trips(tmp_path):
  _write_word_level(tmp_path)
  tok = load_tokenizer(tmp_path)
  assert isinstance(tok, Tokenizer) and isinstance(CharTokenizer(), Tokenizer)
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 0, 5)
  assert tok.encode("hello world") == [2, 3]
  assert tok.decode([2, 3, 1]) == "hello world"


def test_load_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load_tokenizer(tmp_path)
  _write_word_level(tmp_path, with_config=False)
  with pytest.raises(ValueError, match="no eos token"):
    load_tokenizer(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
  assert load_tokenizer(tmp_path / "tokenizer.json").eos_id == 1
