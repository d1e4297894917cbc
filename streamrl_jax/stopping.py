"""A stop asked for by Ctrl-C or SIGTERM, honoured where the program says it is safe to stop.

Python's own handler raises `KeyboardInterrupt` wherever the main thread happens to be: inside a checkpoint
save, between a step's metrics row and its checkpoint, inside a Flight call. A `StopRequest` turns the first
signal into a request while the program is inside `deferred()` (the trainer's steps; a sampler's session): the
code there looks at `requested` at its own safe points (a step boundary) and stops by raising `RunStopped`.
A second signal raises `KeyboardInterrupt` at once, as does any signal outside `deferred()`, where nothing is
in progress that a stop could lose.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator

_log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_EARLY = threading.Event()  # a Ctrl-C that came before any StopRequest was installed (`early_interrupts`)


def early_interrupts() -> None:
  """Ctrl-C before a `StopRequest` is installed (while a command's modules load) raises KeyboardInterrupt, as
  Python's own handler does, and is remembered: where Python cannot deliver it (inside a garbage-collector
  callback it is printed and dropped) the next `installed()` raises it, before anything starts. Main thread only."""
  if threading.current_thread() is threading.main_thread():
    _EARLY.clear()
    signal.signal(signal.SIGINT, _early_interrupt)


def _early_interrupt(signum, frame) -> None:
  _EARLY.set()
  raise KeyboardInterrupt


class RunStopped(Exception):
  """The run stopped on request. `saved_step`: the step of the last checkpoint on disk (None: none);
  `abandoned_step`: a step that was in progress and did not finish within the grace period (None: the run
  stopped at a step boundary)."""

  def __init__(self, saved_step: int | None = None, abandoned_step: int | None = None):
    self.saved_step, self.abandoned_step = saved_step, abandoned_step
    super().__init__(f"stopped (checkpoint of step {saved_step}, abandoned step {abandoned_step})")


class StopRequest:
  """The first STOP_SIGNALS signal inside `deferred()` sets the request (and says so through `log`); the
  second, or any outside `deferred()`, raises KeyboardInterrupt. `request()` sets it without a signal."""

  def __init__(self, log: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
    self._log = log or _log.warning
    self._clock = clock
    self._event = threading.Event()
    self._requested_at: float | None = None
    self._deferring = 0
    self._what = "the step in progress"
    self.signals = 0  # signals received so far (written by the handler, on the main thread)

  @property
  def requested(self) -> bool:
    return self._requested_at is not None

  @property
  def event(self) -> threading.Event:
    """Set once a stop is requested, for loops that wait on an event (they may set it too: `requested` says
    whether a request did)."""
    return self._event

  def request(self) -> None:
    if self._requested_at is None:
      self._requested_at = self._clock()
      self._event.set()

  def overdue(self, grace_s: float) -> bool:
    """Whether a stop was requested more than `grace_s` seconds ago."""
    return self._requested_at is not None and self._clock() - self._requested_at > grace_s

  @contextlib.contextmanager
  def installed(self) -> Iterator[StopRequest]:
    """Handles STOP_SIGNALS while inside (main thread only; elsewhere signals cannot be handled and the
    previous handlers stay)."""
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
    try:
      if _EARLY.is_set():  # a Ctrl-C while modules loaded that Python dropped: stop before anything starts
        raise KeyboardInterrupt
      yield self
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)

  @contextlib.contextmanager
  def deferred(self, what: str = "the step in progress") -> Iterator[StopRequest]:
    """Inside, a first signal is a request that the code inside honours after `what`."""
    self._deferring += 1
    self._what = what
    try:
      yield self
    finally:
      self._deferring -= 1

  def _on_signal(self, signum, frame) -> None:
    self.signals += 1
    if self.requested or not self._deferring:
      raise KeyboardInterrupt
    self.request()
    self._log(f"{signal.Signals(signum).name}: stopping after {self._what} (press Ctrl-C again to stop at once)")
