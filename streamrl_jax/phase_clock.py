"""Where one thread's seconds go: `PhaseClock` splits the thread's wall time into named phases.

The owning thread enters a phase with `with clock.phase("decode"):`; phases nest, and a nested phase's seconds are
its own, not its parent's (a `host` phase around a `decode` one keeps only the host time). Time spent in no phase is
`other`. `take()` returns the seconds of every phase since the last take: they add up to the wall time between the
two takes, so a part that is not timed shows as `other`, never as a missing second. One clock per thread: it is
never shared.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

OTHER = "other"


class PhaseClock:
  """Seconds by phase of one thread's wall time since the last `take()`."""

  def __init__(self, phases: tuple[str, ...], clock: Callable[[], float] = time.perf_counter):
    if OTHER in phases or len(set(phases)) != len(phases):
      raise ValueError(f"phases must be distinct and not {OTHER!r}: {phases}")
    self.phases = phases
    self._clock = clock
    self._stack: list[str] = []
    self._seconds = dict.fromkeys((*phases, OTHER), 0.0)
    self._mark = clock()

  def _charge(self) -> None:
    now = self._clock()
    self._seconds[self._stack[-1] if self._stack else OTHER] += now - self._mark
    self._mark = now

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    if name not in self._seconds or name == OTHER:
      raise ValueError(f"unknown phase {name!r}; this clock's: {self.phases}")
    self._charge()
    self._stack.append(name)
    try:
      yield
    finally:
      self._charge()
      self._stack.pop()

  def take(self) -> dict[str, float]:
    """{phase: seconds} since the last take (`other` last); they sum to the wall time between the takes."""
    self._charge()
    taken, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
    return taken


def accounted_frac(seconds: dict[str, float]) -> float:
  """The share of a `take()`'s wall time that its named phases hold (1.0 for no time at all)."""
  wall = sum(seconds.values())
  return 1.0 - seconds.get(OTHER, 0.0) / wall if wall > 0 else 1.0
