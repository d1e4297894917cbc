"""A periodic check on a thread of its own that tells a pause of this process from the silence of others; the
trainer's stall watch built on it."""

from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Callable


class Watchdog:
  """Calls `check()` every `period` s. A tick that comes late (this process was paused: SIGSTOP, a long GC,
  an overloaded host) calls `paused(seconds late)` instead, so others are not blamed for our own silence."""

  def __init__(self, period: float, check: Callable[[], object], paused: Callable[[float], None],
               clock: Callable[[], float], name: str = "controller-watchdog"):
    self.period, self._check, self._paused, self._clock, self._name = period, check, paused, clock, name
    self._closed = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._watch, daemon=True, name=self._name)
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


STALL_EXIT_CODE = 124  # what a run that stalled exits with


class StallWatch:
  """Ends this process with a one-line reason (and every thread's stack) when `progress` has not been called
  for `limit_s` seconds: a step stuck in a device wait (two programs waiting on each other's collectives)
  cannot be interrupted from Python, and a silent hang is worse than a clear exit. The last committed
  checkpoint stays usable. Pauses of the process itself (SIGSTOP) do not count."""

  def __init__(self, limit_s: float, log: Callable[[str], None], clock: Callable[[], float],
               end: Callable[[int], None] = os._exit):
    self.limit_s, self._log, self._clock, self._end = limit_s, log, clock, end
    self._last, self._what = clock(), "the start"
    self._watchdog = Watchdog(min(10.0, limit_s / 4), self._check, self._paused, clock, name="stall-watch")

  def __enter__(self) -> StallWatch:
    self._watchdog.start()
    return self

  def __exit__(self, *exc) -> None:
    self._watchdog.close()

  def progress(self, what: str) -> None:
    self._last, self._what = self._clock(), what

  def _paused(self, seconds: float) -> None:
    self._last += seconds

  def _check(self) -> None:
    silent = self._clock() - self._last
    if silent > self.limit_s:
      self._log(f"streamrl: the trainer has made no progress for {silent:.0f} s since {self._what} "
                f"(WaitConfig.step_timeout_s={self.limit_s:g}); ending the process with exit code "
                f"{STALL_EXIT_CODE}; the last committed checkpoint is intact")
      faulthandler.dump_traceback(all_threads=True)
      self._end(STALL_EXIT_CODE)
