"""Typed counters: what a part counts, each a declared field, read as a mapping from metric names to numbers.

A part declares its counters as a dataclass of numbers (`@dataclasses.dataclass(slots=True, eq=False)` over
`Counters`) and writes them as attributes (`counters.finished += 1`): a misspelt name fails where it is written, not
as a missing metric later. Metric rows, run records and tests read them as a mapping (`dict(counters)`,
`{**a, **b}`, `counters.finished`), one name per metric.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping


class Counters(Mapping):
  """A part's counters: dataclass fields read as a mapping (subclass with `@dataclasses.dataclass(slots=True,
  eq=False)`); equal to any mapping of the same names and values."""

  __slots__ = ()

  def __getitem__(self, name: str) -> float:
    if name not in self._names():
      raise KeyError(f"{type(self).__name__} counts no {name!r}")
    return getattr(self, name)

  def __iter__(self):
    return iter(self._names())

  def __len__(self) -> int:
    return len(self._names())

  def __repr__(self) -> str:
    return f"{type(self).__name__}({dict(self)})"

  def _names(self) -> tuple[str, ...]:
    return _field_names(type(self))

  def add(self, name: str, amount: float = 1) -> None:
    """Counter `name` (chosen at run time) up by `amount`; an undeclared name is refused."""
    setattr(self, name, self[name] + amount)

  def reset(self) -> None:
    """Every counter back to its starting value."""
    for field in dataclasses.fields(self):
      setattr(self, field.name, field.default)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
  """A counters class's names, found once (a sampler counts on its decode loop)."""
  return tuple(f.name for f in dataclasses.fields(cls))
