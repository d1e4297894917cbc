"""A value bound to a config field, checked against the field's annotation before the config is built.

`checked(cls, name, value)` returns the value as the field holds it (a list given for a tuple becomes a tuple, an
int given for a float a float) or raises `ConfigError` naming `Class.field`, the type it takes and the value given.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import types
import typing


class ConfigError(ValueError):
  """A configuration mistake, said in one line (the command prints it and exits 2)."""


@functools.cache
def field_types(cls) -> dict[str, typing.Any]:
  """{field name: its annotation, resolved} of a config dataclass."""
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(hint) -> str:
  """`int`, `tuple[int, ...]`, `int | None`, `Literal['a', 'b']`: an annotation as a user reads it."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if hint is type(None):
    return "None"
  if origin in (typing.Union, types.UnionType):
    return " | ".join(type_name(a) for a in args)
  if origin is tuple:
    if len(args) == 2 and args[1] is Ellipsis:
      return f"tuple[{type_name(args[0])}, ...]"
    return f"tuple[{', '.join(type_name(a) for a in args)}]"
  if origin is typing.Literal:
    return f"Literal[{', '.join(repr(a) for a in args)}]"
  return getattr(hint, "__name__", str(hint))


_NO = object()


def _conform(value, hint):
  """The value as a field of type `hint` holds it, or `_NO`."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if hint is typing.Any:
    return value
  if hint is type(None):
    return value if value is None else _NO
  if hint is bool:
    return value if isinstance(value, bool) else _NO
  if hint is int:
    return value if isinstance(value, int) and not isinstance(value, bool) else _NO
  if hint is float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
  if hint is str:
    return value if isinstance(value, str) else _NO
  if origin in (typing.Union, types.UnionType):
    for arm in args:
      if (out := _conform(value, arm)) is not _NO:
        return out
    return _NO
  if origin is tuple:
    if not isinstance(value, (tuple, list)):
      return _NO
    arms = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
    if len(arms) != len(value):
      return _NO
    out = tuple(_conform(v, a) for v, a in zip(value, arms))
    return _NO if any(v is _NO for v in out) else out
  if origin is typing.Literal:
    return value if value in args else _NO
  if isinstance(hint, type):
    return value if isinstance(value, hint) else _NO
  return value


def literal_value(text: str) -> tuple[bool, object]:
  """(True, the Python literal `text` spells: '1e-4' -> 0.0001), or (False, None) when it spells none."""
  try:
    return True, ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return False, None


def checked(cls, name: str, value):
  """`value` as field `name` of `cls` holds it; raises `ConfigError` when the annotation does not take it."""
  hint = field_types(cls)[name]
  out = _conform(value, hint)
  if out is _NO:
    given = type(value).__name__
    spelt, unquoted = literal_value(value) if isinstance(value, str) else (False, None)
    hint_text = (f" (without its quotes: --set {cls.__name__}.{name}={value})"
                 if spelt and _conform(unquoted, hint) is not _NO else "")
    raise ConfigError(f"{cls.__name__}.{name} = {value!r}: expected {type_name(hint)}, got {given}{hint_text}")
  return out
