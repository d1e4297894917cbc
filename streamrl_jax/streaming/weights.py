"""Weight sync from the trainer mesh to the sampler mesh, versioned, in the background.

`push(params, version)` enqueues a `jax.device_put` into the sampler's shardings (optionally casting to
bfloat16 first) and returns at once, a worker thread waiting for it, so the transfer overlaps training; `latest()` gives the
newest completed version for the sampler to swap in between decode steps. Across processes the same
interface would sit on `jax.experimental.transfer`.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp


class WeightSync:
  def __init__(self, target_shardings, *, cast_dtype=None):
    self._shardings, self._dtype = target_shardings, cast_dtype
    self._lock = threading.Lock()
    self._latest: tuple[object, int] | None = None
    self._threads: list[threading.Thread] = []
    self.seconds: dict[int, float] = {}
    self._error: BaseException | None = None

  def _finish(self, placed, version: int, start: float) -> None:
    try:
      jax.block_until_ready(placed)
      with self._lock:
        self.seconds[version] = time.perf_counter() - start
        if self._latest is None or version > self._latest[1]:
          self._latest = (placed, version)
    except BaseException as err:  # surfaced by latest()/wait(), never lost
      self._error = err

  def push(self, params, version: int) -> None:
    """Enqueues the copy now (so the trainer may donate `params` to its next step right after) and
    waits for it on a worker thread."""
    start = time.perf_counter()
    if self._dtype is not None:
      params = jax.tree.map(lambda x: x.astype(self._dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    placed = jax.device_put(params, self._shardings)
    thread = threading.Thread(target=self._finish, args=(placed, version, start), daemon=True,
                              name=f"weight-sync-{version}")
    thread.start()
    self._threads = [t for t in self._threads if t.is_alive()] + [thread]

  def latest(self) -> tuple[object, int] | None:
    """(params on the sampler mesh, version) of the newest finished transfer, or None."""
    if self._error is not None:
      raise RuntimeError("weight sync failed") from self._error
    with self._lock:
      return self._latest

  def wait(self) -> None:
    for thread in self._threads:
      thread.join()
    self.latest()
