"""A periodic check on a thread of its own that tells a pause of this process from the silence of others."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Watchdog:
  """Calls `check()` every `period` s. A tick that comes late (this process was paused: SIGSTOP, a long GC,
  an overloaded host) calls `paused(seconds late)` instead, so others are not blamed for our own silence."""

  def __init__(self, period: float, check: Callable[[], object], paused: Callable[[float], None],
               clock: Callable[[], float]):
    self.period, self._check, self._paused, self._clock = period, check, paused, clock
    self._closed = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._watch, daemon=True, name="controller-watchdog")
    self._thread.start()

  def close(self) -> None:
    self._closed.set()
    if self._thread is not None:
      self._thread.join()

  def _watch(self) -> None:
    last = self._clock()
    while not self._closed.wait(self.period):
      now = self._clock()
      if now - last > 2 * self.period + 1.0:
        self._paused(now - last - self.period)
      else:
        self._check()
      last = now
