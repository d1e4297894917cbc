"""Chat templates (the Jinja text in `tokenizer_config.json` or a GGUF's `tokenizer.chat_template`), rendered as
transformers' `apply_chat_template` renders them.

A template is untrusted code: it runs in Jinja's immutable sandbox, with `trim_blocks` and `lstrip_blocks`, the loop
controls (`{% break %}`, `{% continue %}`), `{% generation %}` blocks, the globals `raise_exception`,
`strftime_now`, `dict` and an underscore-refusing `namespace`, and a `tojson` that keeps non-ASCII text and takes
`indent`. It is rendered with `messages`, `add_generation_prompt`, `tools`, `documents`, the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) and any extra keyword. The rendered text already holds every special token
the model expects, so it is encoded without adding any.

`ChatFormat` is one user message (after an optional system message) ready for the assistant: it renders a task's
question as the template does, and maps a rendered prompt back to the question, also when the template writes
a default system message or today's date.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import json
import re

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_PROBE = "\x00streamrl-message\x00"
# Two clocks as far apart as dates get: a template that writes the date renders differently under each.
_CLOCKS = (datetime.datetime(2001, 2, 3, 4, 5, 6), datetime.datetime(2038, 11, 27, 21, 58, 59))


class ChatTemplateError(ValueError):
  """A chat template that does not compile or raises while rendering; the message names the model."""


class _GenerationBlocks(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


class _Namespace(jinja2.utils.Namespace):
  """Jinja's `namespace`, refusing attribute names that start with an underscore (no reach into internals)."""

  def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick: `namespace(self=...)` stays legal
    self, rest = args[0], args[1:]
    attrs = dict(*rest, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _now() -> datetime.datetime:
  return datetime.datetime.now()


def _strftime_now(fmt: str) -> str:
  return _now().strftime(fmt)


def _clock(moment: datetime.datetime):
  return lambda fmt: moment.strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
  """The compiled template; a syntax error is a `ChatTemplateError` with Jinja's message and line."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict, namespace=_Namespace)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as err:
    raise ChatTemplateError(f"the chat template does not compile: {err.message} (template line {err.lineno})") from None


def _plain_messages(messages) -> list[dict]:
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ChatTemplateError(f"chat message {i} is a {type(message).__name__}, not a dict with role and content")
    out.append({k: v for k, v in message.items() if v is not None})  # as transformers: a None key is absent
  return out


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                documents=None, **extra) -> str:
  """The template rendered over `messages` ([{"role", "content"}, ...]) with `tools` (JSON schemas),
  `documents` and `extra` (the tokenizer's special tokens, template options). A template's own refusal
  (`raise_exception`) or a failure while rendering is a `ChatTemplateError` with Jinja's message."""
  if tools is not None and not all(isinstance(t, dict) for t in tools):
    raise ChatTemplateError("chat tools must be JSON schemas (dicts)")
  compiled = compile_template(template)
  try:
    return compiled.render(messages=_plain_messages(messages), tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **extra)
  except jinja2.exceptions.TemplateError as err:
    raise ChatTemplateError(f"the chat template raised: {err.message or type(err).__name__}") from None


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """One user message (after an optional system message) in a chat template, ready for the assistant.

  `wrap` renders the template (today's date included, as transformers would); `unwrap` takes the question back
  out. `prefix` and `suffix` are the text around the message; `pattern` matches a rendered prompt when parts of
  the prefix or suffix change with the clock (None when nothing does)."""

  template: str
  system: str | None
  context: tuple[tuple[str, str], ...]  # the special tokens and options every render gets
  prefix: str
  suffix: str
  pattern: str | None

  @classmethod
  def of(cls, template: str, system: str | None = None, special_tokens: dict | None = None,
         source: str = "the model") -> ChatFormat:
    context = tuple(sorted((special_tokens or {}).items()))
    renders = [render_chat(template, _messages(system, _PROBE), strftime_now=_clock(moment), **dict(context))
               for moment in _CLOCKS]
    if any(text.count(_PROBE) != 1 for text in renders):
      raise ValueError(f"the chat template of {source} does not place the user message verbatim exactly once")
    (prefix, suffix), other = renders[0].split(_PROBE), renders[1].split(_PROBE)
    pattern = None
    if (prefix, suffix) != tuple(other):
      pattern = _pattern(prefix, other[0]) + "(.*)" + _pattern(suffix, other[1])
    return cls(template, system, context, prefix, suffix, pattern)

  def wrap(self, message: str) -> str:
    return render_chat(self.template, _messages(self.system, message), **dict(self.context))

  def unwrap(self, prompt: str) -> str:
    if self.pattern is None:
      if prompt.startswith(self.prefix) and prompt.endswith(self.suffix):
        return prompt[len(self.prefix):len(prompt) - len(self.suffix)]
    else:
      match = re.fullmatch(self.pattern, prompt, re.DOTALL)
      if match:
        return match.group(1)
    raise ValueError(f"not a prompt of this chat format: {prompt[:80]!r}")


def _messages(system: str | None, message: str) -> list[dict]:
  return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]


def _pattern(a: str, b: str) -> str:
  """A regular expression for text rendered as `a` under one clock and `b` under another: the common runs
  literal, the runs that differ (a date, a time) any text."""
  parts, end = [], 0
  for i, _, size in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
    if i > end:
      parts.append(".*?")
    parts.append(re.escape(a[i:i + size]))
    end = i + size
  if len(a) > end:
    parts.append(".*?")
  return "".join(parts)


def end_of_turn_token(template: str, vocab: dict[str, int], special_tokens: dict | None = None) -> str | None:
  """The token that closes an assistant turn in `template` (ChatML `<|im_end|>`, Llama 3 `<|eot_id|>`, `eos_token`
  in Llama 2's): the longest vocabulary token that starts the text rendered right after a probe assistant message;
  None when there is none, or when the template refuses that conversation."""
  try:
    text = render_chat(template, [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
                       add_generation_prompt=False, **(special_tokens or {}))
  except ChatTemplateError:
    return None
  after = text.split(_PROBE, 1)[1].lstrip() if _PROBE in text else ""
  specials = set((special_tokens or {}).values())
  found = [t for t in vocab if after.startswith(t) and (t in specials or (len(t) > 2 and t[0] == "<" and t[-1] == ">"))]
  return max(found, key=len) if found else None
