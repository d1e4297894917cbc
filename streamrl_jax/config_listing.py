"""The configuration as a gin file a user reads: every field of every config on its own line,
`Class.field = value  # type: help`, the help taken from the comment beside (or just above) the field in its
dataclass. Saved to a file, the text is a `--config` that builds the same configs (`streamrl config`; a run's
`WORKDIR/config.gin`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
from typing import TYPE_CHECKING

from streamrl_jax.config_types import field_types, type_name

if TYPE_CHECKING:  # any dataclass instance (typeshed's name; not importable at run time)
  from _typeshed import DataclassInstance


@functools.cache
def field_help(cls) -> dict[str, str]:
  """{field: its help}: the comment lines directly above the field's line, then the comment on it, as one line."""
  source = textwrap.dedent(inspect.getsource(cls))
  lines = source.splitlines()
  comments = {tok.start[0]: tok.string.lstrip("#").strip()
              for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
  start = next(i for i, line in enumerate(lines) if line.startswith("class "))
  body_indent = min(len(line) - len(line.lstrip()) for line in lines[start + 1:] if line.strip())
  out = {}
  for field in dataclasses.fields(cls):
    pattern = re.compile(rf"^ {{{body_indent}}}{field.name}\s*:")
    number = next((i + 1 for i, line in enumerate(lines) if pattern.match(line)), None)
    if number is None:
      continue
    above, row = [], number - 1
    while row >= 1 and lines[row - 1].strip().startswith("#"):
      above.insert(0, comments[row])
      row -= 1
    parts = above + ([comments[number]] if number in comments else [])
    out[field.name] = " ".join(p for p in parts if p)
  return out


def render(configs, derived: dict[str, str] | None = None, header: str = "") -> str:
  """The gin text of config instances, or of (class, {field: value}, note) for a config that does not build yet
  (the note says why). Nested configs are rendered as their own classes, once each; a key in `derived`
  ({"EngineConfig.max_new_tokens": "PipelineConfig.max_new_tokens"}) is written as a comment."""
  derived = derived or {}
  out = [f"# {line}".rstrip() for line in header.splitlines()]
  for cls, values, note in _sections(configs):
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    title = f"# {cls.__name__}: {doc}" if doc and not doc.startswith(cls.__name__ + "(") else f"# {cls.__name__}"
    out += ["", title] + ([f"# ({note})"] if note else [])
    helps, types_ = field_help(cls), field_types(cls)
    for name, value in values.items():
      key = f"{cls.__name__}.{name}"
      if key in derived:
        out.append(f"# {key} = {value!r}  # set from {derived[key]}")
      else:
        out.append(f"{key} = {value!r}  # {type_name(types_[name])}: {helps.get(name, '')}".rstrip(": "))
  return "\n".join(out).lstrip("\n") + "\n"


def _sections(configs) -> list[tuple[type, dict, str]]:
  """(class, its plain fields' values, note) of each config, then of the configs nested in it, depth first,
  each class once."""
  seen, out = set(), []

  def visit(config: DataclassInstance | tuple[type, dict, str]) -> None:
    cls, values, note = config if isinstance(config, tuple) else (type(config), _plain(config), "")
    if cls in seen:
      return
    seen.add(cls)
    out.append((cls, values, note))
    if not isinstance(config, tuple):
      for field in dataclasses.fields(config):
        if dataclasses.is_dataclass(value := getattr(config, field.name)):
          visit(value)
  for config in configs:
    visit(config)
  return out


def _plain(config: DataclassInstance) -> dict:
  """{field: value} of a config's fields that are not configs themselves."""
  values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if "bound_by" not in f.metadata}
  return {k: v for k, v in values.items() if not dataclasses.is_dataclass(v)}
