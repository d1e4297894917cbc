"""Tokenizers behind one interface: Hugging Face `tokenizer.json` and a built-in character tokenizer.

`encode` is the plain encoding (completions, answers, tool output, rendered chat prompts); `encode_prompt` is a raw
prompt as transformers' `tokenizer(text)` gives it, with the special tokens the tokenizer's post-processor adds
(BOS for Llama, Mistral and Gemma tokenizers); `apply_chat_template` is a conversation rendered by the model's
template and encoded without adding any; `stop_ids` are every id that ends a turn.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers
from tokenizers import processors

from streamrl_jax.models.chat import ChatFormat, ChatTemplateError, compile_template, end_of_turn_token, render_chat

# The named special tokens transformers hands a chat template (`special_tokens_map`).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@runtime_checkable
class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int
  pad_id: int
  chat_template: str | None

  stop_ids: tuple[int, ...]

  def encode(self, text: str) -> list[int]: ...

  def encode_prompt(self, text: str) -> list[int]: ...

  def decode(self, ids) -> str: ...

  def token_text(self, token: int) -> str: ...


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
    self.stop_ids = (self.eos_id,)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[c] for c in text]
    except KeyError as err:
      raise ValueError(f"character {err.args[0]!r} is not in the CharTokenizer alphabet") from None

  def encode_prompt(self, text: str) -> list[int]:
    """A raw prompt: no BOS (the demo model is trained without one)."""
    return self.encode(text)

  def token_text(self, token: int) -> str:
    """One token's text (a special token's name)."""
    token = int(token)
    return self.SPECIALS[token] if token < len(self.SPECIALS) else self.alphabet[token - len(self.SPECIALS)]

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
  """A Hugging Face `tokenizer.json` through the tokenizers library (no transformers needed), with the model's
  chat template (Jinja text), its special tokens and the ids that end a turn. `name` (the model directory) is
  named in every error."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, eos_id: int, pad_id: int, chat_template: str | None = None,
               special_tokens: dict[str, str] | None = None, stop_ids: tuple[int, ...] = (), name: str = "tokenizer"):
    self._tok = tokenizer
    self.eos_id, self.pad_id = eos_id, pad_id
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.chat_template = chat_template
    self.special_tokens = dict(special_tokens or {})
    self.stop_ids = tuple(dict.fromkeys((eos_id, *stop_ids)))
    self.name = name

  def vocab(self) -> dict[str, int]:
    return self._tok.get_vocab(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_prompt(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=True).ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def token_text(self, token: int) -> str:
    """One token's text as a template writes it (a special token's included)."""
    return self._tok.decode([int(token)], skip_special_tokens=False)

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **extra) -> str:
    """The conversation as the model's template writes it, special tokens included."""
    try:
      return render_chat(self._template(), messages, add_generation_prompt, tools, **{**self.special_tokens, **extra})
    except ChatTemplateError as err:
      raise ChatTemplateError(f"{self.name}: {err}") from None

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                          **extra) -> list[int]:
    """The ids of the rendered conversation, encoded without adding special tokens a second time (transformers'
    `apply_chat_template(..., tokenize=True)`)."""
    return self.encode(self.render_chat(messages, add_generation_prompt, tools, **extra))

  def chat_format(self, system: str | None = None, options: dict | None = None) -> ChatFormat:
    """One user message (after `system`) in the model's template, rendered with template `options` too (Qwen3's
    `enable_thinking`)."""
    try:
      return ChatFormat.of(self._template(), system, {**self.special_tokens, **(options or {})}, source=self.name)
    except ChatTemplateError as err:
      raise ChatTemplateError(f"{self.name}: {err}") from None

  def _template(self) -> str:
    if not self.chat_template:
      raise ValueError(f"{self.name} has no chat template (tokenizer_config.json: chat_template)")
    return self.chat_template


def _special_id(tok: tokenizers.Tokenizer, value) -> int | None:
  value = _content(value)
  return tok.token_to_id(value) if isinstance(value, str) else None


def _content(value):
  return value.get("content") if isinstance(value, dict) else value  # an AddedToken serialised as {"content": ...}


def _json(file: Path) -> dict:
  if not file.exists():
    return {}
  try:
    data = json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise ValueError(f"{file} is not valid JSON: {err}") from None
  if not isinstance(data, dict):
    raise ValueError(f"{file} must hold a JSON object, not {type(data).__name__}")
  return data


def _eos_ids(value, file: Path) -> list[int]:
  values = value if isinstance(value, list) else [] if value is None else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    raise ValueError(f"{file}: eos_token_id must be an id or a list of ids, not {value!r}")
  return values


def special_post_processor(tok: tokenizers.Tokenizer, bos: str | None, eos: str | None, add_bos: bool,
                           add_eos: bool) -> processors.TemplateProcessing:
  """BOS before and EOS after a text, as `add_bos_token` / `add_eos_token` ask (a GGUF's flags)."""
  add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
  single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
  pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
  specials = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
  return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
  """Loads `tokenizer.json` (a file, or a model directory holding it) as transformers 5 does: its post-processor
  decides what a raw prompt gets (tokenizer_config.json's `add_bos_token` does not override it); special tokens
  from tokenizer_config.json (special_tokens_map.json fills in); eos from eos_token, else config.json; the stop
  ids add generation_config.json's (else config.json's) `eos_token_id` and the chat template's end-of-turn token.
  The template is compiled here, so a broken one fails at start."""
  path = Path(path)
  directory = path if path.is_dir() else path.parent
  file = path / "tokenizer.json" if path.is_dir() else path
  if not file.exists():
    raise FileNotFoundError(f"{file} not found: load_tokenizer needs a tokenizer.json")
  tok = tokenizers.Tokenizer.from_file(str(file))
  settings = _json(directory / "tokenizer_config.json")
  for key, value in _json(directory / "special_tokens_map.json").items():
    settings.setdefault(key, value)
  special = {k: _content(settings[k]) for k in SPECIAL_TOKEN_KEYS if isinstance(_content(settings.get(k)), str)}
  model_config = _json(directory / "config.json")
  eos = _special_id(tok, settings.get("eos_token"))
  if eos is None:
    eos_ids = _eos_ids(model_config.get("eos_token_id"), directory / "config.json")
    eos = eos_ids[0] if eos_ids else None
  if eos is None:
    raise ValueError(f"no eos token found for {file}: set eos_token in tokenizer_config.json")
  generation_file = directory / "generation_config.json"
  generation = _json(generation_file)
  stops = (_eos_ids(generation.get("eos_token_id"), generation_file) if "eos_token_id" in generation
           else _eos_ids(model_config.get("eos_token_id"), directory / "config.json"))
  template = settings.get("chat_template")
  template = template if isinstance(template, str) else None
  name = str(directory)
  if template:
    try:
      compile_template(template)
      turn_end = end_of_turn_token(template, tok.get_vocab(with_added_tokens=True), special)
    except ChatTemplateError as err:
      raise ChatTemplateError(f"{name}: {err}") from None
    if turn_end is not None:
      stops.append(tok.token_to_id(turn_end))
  vocab = tok.get_vocab_size(with_added_tokens=True)
  outside = [i for i in stops if not 0 <= i < vocab]
  if outside:
    raise ValueError(f"{directory}: eos_token_id {outside[0]} is outside the vocabulary of {vocab}")
  pad = _special_id(tok, settings.get("pad_token"))
  return HFTokenizer(tok, eos_id=eos, pad_id=eos if pad is None else pad, chat_template=template,
                     special_tokens=special, stop_ids=tuple(stops), name=name)
