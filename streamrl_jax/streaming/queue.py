"""A bounded, typed, in-process sample queue: backpressure instead of drops, a clean close, counters.

`SampleTransport` is the interface the pipeline uses; a network transport implements the same methods.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Protocol

from streamrl_jax.streaming.shard import SampleShard


class QueueClosed(Exception):
  """get() on a closed and drained queue, or put() on a closed queue."""


class SampleTransport(Protocol):
  def put(self, shard: SampleShard, timeout: float | None = None) -> None: ...

  def get(self, timeout: float | None = None) -> SampleShard: ...

  def close(self) -> None: ...

  def stats(self) -> dict: ...


class SampleQueue:
  """At most `capacity` samples in flight. put() blocks while full and raises TimeoutError after
  `timeout` (the shard is not enqueued, never silently dropped); get() blocks while empty."""

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"SampleQueue capacity must be >= 1, got {capacity}")
    self.capacity = capacity
    self._items: collections.deque[SampleShard] = collections.deque()
    self._samples = 0
    self._closed = False
    self._cond = threading.Condition()
    self._stats = dict(put_shards=0, put_samples=0, got_shards=0, got_samples=0, max_depth=0, put_wait_s=0.0,
                       get_wait_s=0.0)

  def put(self, shard: SampleShard, timeout: float | None = None) -> None:
    if not isinstance(shard, SampleShard):
      raise TypeError(f"SampleQueue takes SampleShard, got {type(shard).__name__}")
    if shard.num_samples > self.capacity:
      raise ValueError(f"a shard of {shard.num_samples} samples can never fit a queue of capacity {self.capacity}")
    start = time.perf_counter()
    with self._cond:
      ok = self._cond.wait_for(lambda: self._closed or self._samples + shard.num_samples <= self.capacity, timeout)
      self._stats["put_wait_s"] += time.perf_counter() - start
      if self._closed:
        raise QueueClosed("put() on a closed SampleQueue")
      if not ok:
        raise TimeoutError(f"SampleQueue full ({self._samples}/{self.capacity} samples) for {timeout} s")
      self._items.append(shard)
      self._samples += shard.num_samples
      self._stats["put_shards"] += 1
      self._stats["put_samples"] += shard.num_samples
      self._stats["max_depth"] = max(self._stats["max_depth"], self._samples)
      self._cond.notify_all()

  def get(self, timeout: float | None = None) -> SampleShard:
    start = time.perf_counter()
    with self._cond:
      ok = self._cond.wait_for(lambda: self._items or self._closed, timeout)
      self._stats["get_wait_s"] += time.perf_counter() - start
      if not ok:
        raise TimeoutError(f"SampleQueue empty for {timeout} s")
      if not self._items:
        raise QueueClosed("SampleQueue is closed and drained")
      shard = self._items.popleft()
      self._samples -= shard.num_samples
      self._stats["got_shards"] += 1
      self._stats["got_samples"] += shard.num_samples
      self._cond.notify_all()
      return shard

  def close(self) -> None:
    """No more puts; gets drain what is queued, then raise QueueClosed."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def __len__(self) -> int:
    with self._cond:
      return self._samples

  def stats(self) -> dict:
    with self._cond:
      return dict(self._stats, depth=self._samples, closed=self._closed)
