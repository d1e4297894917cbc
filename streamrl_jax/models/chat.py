"""Chat templates (the Jinja text in `tokenizer_config.json` or a GGUF's `tokenizer.chat_template`).

Rendered in a sandboxed Jinja environment, as Hugging Face does. `ChatFormat` wraps a single user turn:
it learns the template's text before and after the message once, so a formatted prompt maps back to the
task's own text without a lookup table.
"""

from __future__ import annotations

import dataclasses
import functools

_PROBE = "\x00streamrl-message\x00"


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  from jinja2.exceptions import TemplateError
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
  """The template rendered over `messages` ([{"role", "content"}, ...])."""
  return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """One user message (after an optional system message) in a chat template, ready for the assistant."""

  prefix: str
  suffix: str

  @classmethod
  def of(cls, template: str, system: str | None = None) -> ChatFormat:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _PROBE}]
    text = render_chat(template, messages)
    if text.count(_PROBE) != 1:
      raise ValueError("the chat template does not place the user message verbatim exactly once")
    prefix, suffix = text.split(_PROBE)
    return cls(prefix, suffix)

  def wrap(self, message: str) -> str:
    return self.prefix + message + self.suffix

  def unwrap(self, prompt: str) -> str:
    if not (prompt.startswith(self.prefix) and prompt.endswith(self.suffix)):
      raise ValueError(f"not a prompt of this chat format: {prompt[:80]!r}")
    return prompt[len(self.prefix):len(prompt) - len(self.suffix)]


def end_of_turn_token(template: str, vocab: dict[str, int]) -> str | None:
  """The token that closes an assistant turn in `template` (ChatML `<|im_end|>`, Llama 3 `<|eot_id|>`,
  ...): the first special-looking token rendered right after a probe assistant message."""
  text = render_chat(template, [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
                     add_generation_prompt=False)
  after = text.split(_PROBE, 1)[1] if _PROBE in text else ""
  for token in sorted((t for t in vocab if t.startswith("<") and t.endswith(">") and len(t) > 2), key=len,
                      reverse=True):
    if after.lstrip().startswith(token):
      return token
  return None
