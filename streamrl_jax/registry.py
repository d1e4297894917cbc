"""Name -> function registries, so configs pick algorithms by name and errors list what exists."""

from __future__ import annotations

from collections.abc import Callable


class Registry:
  def __init__(self, kind: str):
    self.kind, self._items = kind, {}

  def register(self, name: str) -> Callable:
    def add(fn):
      if name in self._items:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._items[name] = fn
      return fn
    return add

  def get(self, name: str):
    if name not in self._items:
      raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self._items)}")
    return self._items[name]

  def names(self) -> list[str]:
    return sorted(self._items)
