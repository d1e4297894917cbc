"""Weight transport between the trainer and the sampler: the two interfaces and the in-process one.

The trainer calls `publish(params, version)` and goes on (the transfer overlaps its next step); the
sampler calls `latest()` between decode steps and `wait_for(version)` at a step's version gate. A version
travels at the sampler's precision (`models.precision`: the trainer's half `to_wire`, the sampler's
`Landing`). In one process, `WeightSync` does a `jax.device_put` into the sampler mesh's shardings; across
processes the Arrow Flight transport implements the same two interfaces
(`streaming.flight_server.HostWeightStore`, `streaming.flight_client.FlightWeightReceiver`).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import jax

from streamrl_jax import launch
from streamrl_jax.messages import WeightUpdate
from streamrl_jax.models.precision import Landing, SamplerPrecision, to_wire


class WeightPublisher(Protocol):
  seconds: dict[int, float]  # version -> seconds its transfer took

  def publish(self, params, version: int) -> None: ...

  def wait(self) -> None: ...


class WeightSource(Protocol):
  def latest(self) -> WeightUpdate | None: ...

  def wait_for(self, version: int, timeout: float | None = None) -> WeightUpdate: ...


class LatestWeights:
  """The `WeightSource` half that both transports share: the newest update received so far, or the error
  that stopped receiving (raised by every later read, never lost). `offer` keeps an update if it is newer."""

  def __init__(self, failure: str):
    self._failure = failure
    self._cond = threading.Condition()
    self._latest: WeightUpdate | None = None
    self._error: BaseException | None = None

  def offer(self, update: WeightUpdate) -> None:
    with self._cond:
      if self._latest is None or update.version > self._latest.version:
        self._latest = update
      self._cond.notify_all()

  def fail(self, err: BaseException | None) -> None:
    with self._cond:
      self._error = err
      self._cond.notify_all()

  @property
  def version(self) -> int:
    """The newest version held (-1: none yet)."""
    with self._cond:
      return -1 if self._latest is None else self._latest.version

  def _raise_error(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"{self._failure}: {self._error}") from self._error

  def latest(self) -> WeightUpdate | None:
    """The newest version that has landed on the sampler mesh, or None."""
    with self._cond:
      self._raise_error()
      return self._latest

  def wait_for(self, version: int, timeout: float | None = None) -> WeightUpdate:
    """The newest landed version once it is >= `version`; TimeoutError after `timeout` seconds."""
    with self._cond:
      ok = self._cond.wait_for(lambda: self._error is not None or (self._latest is not None
                                                                   and self._latest.version >= version), timeout)
      self._raise_error()
      if not ok:
        have = None if self._latest is None else self._latest.version
        raise TimeoutError(f"weights of version {version} did not arrive within {timeout} s (have {have})")
      return self._latest


class WeightSync:
  """In-process `WeightPublisher` and `WeightSource`: versions land on the sampler mesh in the background."""

  def __init__(self, landing: Landing, precision: SamplerPrecision = SamplerPrecision()):
    self._landing, self._precision = landing, precision
    self._held = LatestWeights("weight sync failed")
    self._threads: list[threading.Thread] = []
    self.seconds: dict[int, float] = {}

  def _finish(self, placed, version: int, start: float) -> None:
    try:
      placed = jax.block_until_ready(self._landing.finish(placed))
      self.seconds[version] = time.perf_counter() - start
      self._held.offer(WeightUpdate(version, placed))
    except BaseException as err:  # surfaced by latest()/wait_for()/wait(), never lost
      self._held.fail(err)

  def publish(self, params, version: int) -> None:
    """Enqueues the copy now (so the trainer may donate `params` to its next step right after) and
    waits for it on a worker thread."""
    start = time.perf_counter()
    placed = launch.put(to_wire(params, self._precision), self._landing.shardings)
    thread = threading.Thread(target=self._finish, args=(placed, version, start), daemon=True,
                              name=f"weight-sync-{version}")
    thread.start()
    self._threads = [t for t in self._threads if t.is_alive()] + [thread]

  def latest(self) -> WeightUpdate | None:
    return self._held.latest()

  def wait_for(self, version: int, timeout: float | None = None) -> WeightUpdate:
    return self._held.wait_for(version, timeout)

  def wait(self) -> None:
    for thread in self._threads:
      thread.join()
    self.latest()
