"""Tokenizers behind one interface: Hugging Face `tokenizer.json` and a built-in character tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers


@runtime_checkable
class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int
  pad_id: int
  chat_template: str | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids) -> str: ...


CHAR_ALPHABET = "0123456789+-*/=()<>.,:;!? \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ#_'\""


class CharTokenizer:
  """One token per character of a fixed alphabet, after the specials pad=0, bos=1, eos=2."""

  SPECIALS = ("<pad>", "<bos>", "<eos>")
  chat_template = None

  def __init__(self, alphabet: str = CHAR_ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError("CharTokenizer alphabet has repeated characters")
    self.alphabet = alphabet
    self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.vocab_size = len(self.SPECIALS) + len(alphabet)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[c] for c in text]
    except KeyError as err:
      raise ValueError(f"character {err.args[0]!r} is not in the CharTokenizer alphabet") from None

  def decode(self, ids) -> str:
    """Characters of `ids`, stopping at the first eos; pad and bos are skipped."""
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i >= len(self.SPECIALS):
        out.append(self.alphabet[i - len(self.SPECIALS)])
    return "".join(out)


class HFTokenizer:
  """A Hugging Face `tokenizer.json` through the tokenizers library (no transformers needed), with the
  model's chat template (Jinja text) when its `tokenizer_config.json` has one."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, eos_id: int, pad_id: int, chat_template: str | None = None):
    self._tok = tokenizer
    self.eos_id, self.pad_id = eos_id, pad_id
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.chat_template = chat_template

  def vocab(self) -> dict[str, int]:
    return self._tok.get_vocab(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _special_id(tok: tokenizers.Tokenizer, value) -> int | None:
  if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
    value = value.get("content")
  return tok.token_to_id(value) if isinstance(value, str) else None


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
  """Loads `tokenizer.json` (a file, or a model directory holding it); eos/pad come from
  tokenizer_config.json, else config.json's eos_token_id; pad falls back to eos."""
  path = Path(path)
  directory = path if path.is_dir() else path.parent
  file = path / "tokenizer.json" if path.is_dir() else path
  if not file.exists():
    raise FileNotFoundError(f"{file} not found: load_tokenizer needs a tokenizer.json")
  tok = tokenizers.Tokenizer.from_file(str(file))
  settings = {}
  if (directory / "tokenizer_config.json").exists():
    settings = json.loads((directory / "tokenizer_config.json").read_text())
  eos = _special_id(tok, settings.get("eos_token"))
  if eos is None and (directory / "config.json").exists():
    eos_value = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    eos = eos_value[0] if isinstance(eos_value, list) else eos_value
  if eos is None:
    raise ValueError(f"no eos token found for {file}: set eos_token in tokenizer_config.json")
  pad = _special_id(tok, settings.get("pad_token"))
  template = settings.get("chat_template")
  return HFTokenizer(tok, eos_id=eos, pad_id=eos if pad is None else pad,
                     chat_template=template if isinstance(template, str) else None)
