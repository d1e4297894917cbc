"""Reward functions found by import path, checked against a dataset row, and called with their value checked.

`call` is what a scoring worker runs: it imports the function by its path (once per process) and returns
("ok", value) or ("bad", what was wrong), so nothing unpicklable or non-numeric leaves a worker.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path

QUOTE = 60
_LOADED: dict[str, object] = {}


class RewardFunctionError(ValueError):
  """A configured reward function that cannot be used: it does not import, is missing, or has the wrong signature."""


def load_function(spec: str, what: str = "reward function"):
  """The callable at `spec` ('package.module:function' or 'path/to/file.py:function'), imported once per process; a
  file's own folder goes on `sys.path` (last), so it imports the modules beside it. `what` names it in errors."""
  fn = load_attribute(spec, what)
  if not callable(fn):
    raise RewardFunctionError(f"{what} {spec!r}: {spec.rpartition(':')[2]!r} is a {type(fn).__name__}, not a "
                              f"function")
  return fn


def load_attribute(spec: str, what: str):
  """What `spec` ('package.module:name' or 'path/to/file.py:name') names, imported as `load_function` does."""
  if spec in _LOADED:
    return _LOADED[spec]
  where, _, name = spec.rpartition(":")
  if where.endswith(".py") or "/" in where or "\\" in where:
    module = _load_file(spec, Path(where).expanduser(), what)
  else:
    try:
      module = importlib.import_module(where)
    except ModuleNotFoundError as err:
      raise RewardFunctionError(f"{what} {spec!r}: module {err.name!r} not found "
                                f"(is it installed, or on PYTHONPATH?)") from None
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing
      raise RewardFunctionError(f"{what} {spec!r}: importing {where} raised {_describe(err)}") from err
  fn = getattr(module, name, None)
  if fn is None:
    raise RewardFunctionError(f"{what} {spec!r}: {where} has no {name!r}")
  _LOADED[spec] = fn
  return fn


def _load_file(spec: str, path: Path, what: str):
  if not path.is_file():
    raise RewardFunctionError(f"{what} {spec!r}: file {path} not found (relative paths start at "
                              f"{Path.cwd()})")
  module_name = "streamrl_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
  if module_name in sys.modules:
    return sys.modules[module_name]
  folder = str(path.resolve().parent)
  if folder not in sys.path:  # its neighbours import (last on the path: it shadows no installed package)
    sys.path.append(folder)
  module_spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[module_name] = module
  try:
    module_spec.loader.exec_module(module)
  except ModuleNotFoundError as err:
    del sys.modules[module_name]
    raise RewardFunctionError(f"{what} {spec!r}: importing {path} raised {_describe(err)} (its own folder "
                              f"{folder} is on the path; is {err.name!r} installed?)") from err
  except Exception as err:  # noqa: BLE001 - the user's file failed while importing
    del sys.modules[module_name]
    raise RewardFunctionError(f"{what} {spec!r}: importing {path} raised {_describe(err)}") from err
  return module


def check_signature(spec: str, prompt: str, fields: dict) -> None:
  """The function at `spec` can be called as fn(prompt, completion, **fields) with this row's fields."""
  fn = load_function(spec)
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return  # a builtin or C function: its call will tell
  batched = [p for p in ("prompts", "completions") if p in signature.parameters]
  if batched:
    raise RewardFunctionError(f"reward function {spec!r}{signature} takes {batched[0]!r}: TRL's batched form "
                              f"(lists in, a list out); here a reward function scores one completion as "
                              f"fn(prompt, completion, **fields) -> float, called once per sample")
  try:
    signature.bind(prompt, "", **fields)
  except TypeError as err:
    raise RewardFunctionError(
        f"reward function {spec!r}{signature} cannot be called as fn(prompt, completion, **fields) with this "
        f"dataset's fields {sorted(fields)}: {err} (add **fields to take columns it does not use)") from None


def checked_value(value) -> tuple[float | None, str]:
  """(the reward as a float, "") or (None, what is wrong with it): a bool counts as 0 or 1; NaN, inf, text, None
  and anything not a real number are refused."""
  if isinstance(value, (bool, numbers.Real)) and not isinstance(value, complex):
    number = float(value)
    if math.isfinite(number):
      return number, ""
    return None, f"returned {number}"
  shape = getattr(value, "shape", None)
  if shape == () and hasattr(value, "item"):  # a 0-d numpy or jax array
    return checked_value(value.item())
  batch = " (a function here scores one completion a call, not a batch as TRL's do)" if isinstance(
      value, (list, tuple)) else ""
  return None, f"returned a {type(value).__name__} ({_quote(value)}), not a number{batch}"


def call(spec: str, prompt: str, completion: str, fields: dict) -> tuple[str, object]:
  """What a scoring worker runs: the function at `spec`, called and checked (`checked_call`)."""
  return checked_call(load_function(spec), prompt, completion, fields)


def checked_call(fn, prompt: str, completion: str, fields: dict) -> tuple[str, object]:
  """fn(prompt, completion, **fields) as ("ok", reward) or ("bad", what was wrong); an exception is reported, not
  raised."""
  try:
    value = fn(prompt, completion, **fields)
  except Exception as err:  # noqa: BLE001 - the user's function failed: its caller decides what that means
    return "bad", f"raised {_describe(err)}"
  number, problem = checked_value(value)
  return ("ok", number) if problem == "" else ("bad", problem)


def _describe(err: BaseException) -> str:
  return f"{type(err).__name__}: {_quote(str(err), 200)}" if str(err) else type(err).__name__


def _quote(value, limit: int = QUOTE) -> str:
  text = value if isinstance(value, str) else repr(value)
  return text if len(text) <= limit else text[:limit] + "..."
