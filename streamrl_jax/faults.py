"""Faults injected at named points of the trainer's step, so tests stop a run exactly there instead of
racing the clock.

`STREAMRL_FAULT="POINT@STEP=ACTION[,POINT@STEP=ACTION...]"`: when the trainer (its process 0, which decides
stops, or the process `STREAMRL_FAULT_PROCESS` names in a trainer of several) passes POINT while finishing step
STEP (counted from 1, as metrics rows are), it does ACTION. Points, in the order a step passes them:

  publish  the step's new weights are being published (the copy is in flight)
  row      the step's metrics row is written; its checkpoint is not yet saved
  save     the step's checkpoint is being written (orbax's asynchronous save has not been waited for)

Actions: `sigint` / `sigterm` signal the trainer's own process (a Ctrl-C landing exactly there); `sigkill` ends
it at once (no handler runs, as with an out-of-memory kill); `pause` writes `POINT@STEP` to the file named by
`STREAMRL_FAULT_FILE` and waits until a signal reaches the process (at most `PAUSE_LIMIT_S`), so a test can
signal another process (the launcher) knowing where the trainer stands; `hold` writes that file too and waits until
it is removed (at most `PAUSE_LIMIT_S`), then goes on, so a test can fault the samplers while the run stands at a
known step (its controller and server still answer) and then let it continue; `hang` never returns (a step stuck as
a device wait would be: only the stall watch, `WaitConfig.step_timeout_s`, or a second Ctrl-C ends it).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

from streamrl_jax.stopping import StopRequest

ENV, FILE_ENV, PROCESS_ENV = "STREAMRL_FAULT", "STREAMRL_FAULT_FILE", "STREAMRL_FAULT_PROCESS"
POINTS = ("publish", "row", "save")
ACTIONS = ("sigint", "sigterm", "sigkill", "pause", "hold", "hang")
PAUSE_LIMIT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Fault:
  point: str
  step: int
  action: str


def parse_faults(text: str) -> tuple[Fault, ...]:
  """`POINT@STEP=ACTION,...` as Faults; a malformed entry is refused by name."""
  faults = []
  for entry in filter(None, (part.strip() for part in text.split(","))):
    where, _, action = entry.partition("=")
    point, _, step = where.partition("@")
    if point not in POINTS or action not in ACTIONS or not step.isdigit() or int(step) < 1:
      raise ValueError(f"{ENV}: {entry!r} is not POINT@STEP=ACTION with POINT one of {list(POINTS)}, STEP >= 1 "
                       f"and ACTION one of {list(ACTIONS)}")
    faults.append(Fault(point, int(step), action))
  return tuple(faults)


class FaultPoints:
  """The faults of this process (from `STREAMRL_FAULT`); `hit(point, step)` does the matching ones."""

  def __init__(self, faults: tuple[Fault, ...] = (), stop: StopRequest | None = None, mark_file: str = ""):
    held = next((f for f in faults if f.action == "hold"), None)
    if held is not None and not mark_file:
      raise ValueError(f"{ENV}: '{held.point}@{held.step}=hold' waits on a file: set {FILE_ENV} to its path")
    self.faults, self._stop, self._mark_file = faults, stop, mark_file

  @classmethod
  def from_env(cls, stop: StopRequest | None = None) -> FaultPoints:
    return cls(parse_faults(os.environ.get(ENV, "")), stop, os.environ.get(FILE_ENV, ""))

  @classmethod
  def of_trainer_process(cls, process: int, stop: StopRequest | None) -> FaultPoints:
    """The faults of trainer process `process` (with `stop`: the one that decides stops): those of the environment
    when `STREAMRL_FAULT_PROCESS` names it (default 0, the deciding one), none otherwise."""
    chosen = os.environ.get(PROCESS_ENV, "0")
    if not chosen.isdigit():
      raise ValueError(f"{PROCESS_ENV}={chosen!r}: expected a trainer process index")
    deciding = stop is not None or process != 0
    return cls.from_env(stop) if deciding and int(chosen) == process else cls()

  def hit(self, point: str, step: int) -> None:
    for fault in self.faults:
      if (fault.point, fault.step) == (point, step):
        self._act(fault)

  def _act(self, fault: Fault) -> None:
    while fault.action == "hang":
      time.sleep(3600)
    if fault.action in ("pause", "hold"):
      seen = self._stop.signals if self._stop is not None else 0
      if self._mark_file:  # whole or absent: a watcher that sees the file reads the point
        part = f"{self._mark_file}.{os.getpid()}.part"
        with open(part, "w") as out:
          out.write(f"{fault.point}@{fault.step}")
        os.replace(part, self._mark_file)
      deadline = time.monotonic() + PAUSE_LIMIT_S
      waiting = ((lambda: os.path.exists(self._mark_file)) if fault.action == "hold"
                 else (lambda: self._stop is None or self._stop.signals == seen))
      while time.monotonic() < deadline and waiting():
        time.sleep(0.05)  # a signal's handler runs on this (the main) thread, between two sleeps
      return
    sig = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[fault.action]
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs here, at this point of the step
