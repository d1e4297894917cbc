"""A trainer of several processes without a central data node: each process takes the groups it owns
(`step_plan.group_owner`) at its own Flight door, and keeps their tokens.

What the processes share is the rows' description, never their tokens: at each poll every process says which
samples arrived at its door (keys, rewards, versions, token counts: `ROW_BYTES` and 4 per reward function a sample
before compression, about a fifth of that after, against about 17 bytes per token for the tokens), by one small
all-gather, so that every process holds the same view of each shard and the trainer worker takes the same decisions
everywhere (which samples to train, when a step is whole, what a metrics row says). A shard of that view holds the
tokens of its owner's rows alone; the trainer lays each call's rows on their owners' devices
(`training.owned_rows`). Process 0 adds a stop flag to its part of the all-gather (`stop`): the others leave at
the same poll.

The door of a process other than 0 (`FlightDoor`) asks process 0's controller about each batch with a `Delivery`
(its groups' ids and lengths) before acknowledging it, so the lease rules and the plans stay in one place.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from streamrl_jax.counters import Counters
from streamrl_jax import launch
from streamrl_jax.messages import BadShard, Delivery, DeliveryStatus
from streamrl_jax.pipeline.controller.door import shard_groups
from streamrl_jax.streaming import SampleShard
from streamrl_jax.streaming.flight_client import FlightConnection
from streamrl_jax.streaming.queue import QueueClosed, SampleQueue
from streamrl_jax.streaming.shard import STATS

POLL_S = 0.1  # how long a process waits at its own door before the processes compare what arrived
INTS = ("group_ids", "sample_indices", "steps", "first_versions", "last_versions", "reward_errors", "reward_timeouts")
ROW_BYTES = 8 * (len(INTS) + len(STATS) + 2) + 4  # a row's description (length, owner, reward), reward parts apart


class IntakeStopped(Exception):
  """Process 0 stopped taking samples: the other processes stop with it."""


class FlightDoor:
  """The sample door's controller on a trainer process other than 0: each batch's groups go to process 0's
  controller as a `Delivery`; its answer is the door's."""

  def __init__(self, connection: FlightConnection | None, group_size: int):
    self.connection, self.group_size = connection, group_size
    self.door = self  # what the Flight server asks about each batch

  def handlers(self) -> dict:
    return {}  # control messages go to process 0

  def on_shard(self, sampler_id: int, shard) -> str:
    step, lengths = shard_groups(shard, self.group_size)
    reply = self.connection.action(Delivery(sampler_id, step, tuple(lengths), tuple(lengths.values())),
                                   DeliveryStatus)
    if reply.status == "refused":
      raise BadShard(reply.reason)
    return reply.status

  def shard_refused(self, reason: str) -> None:
    """Counted by this door's server; process 0 hears of batches it judged only."""

  def weight_source(self, sampler_id: int, version: int) -> str:
    return ""  # a door of samples alone holds no weights


@dataclasses.dataclass(slots=True, eq=False)
class IntakeCounters(Counters):
  """A trainer process's polls, the samples it took at its door and in the shared view, and the
  description bytes exchanged."""

  intake_polls: int = 0
  intake_local_samples: int = 0
  intake_samples: int = 0
  intake_description_bytes: int = 0
  intake_peer_description_bytes: int = 0


class ProcessIntake:
  """`get(timeout)`: the next shard of the processes' shared view of what arrived, its tokens where they arrived.
  Every process calls it in the same order (a collective each poll)."""

  def __init__(self, queue: SampleQueue, reward_functions: int, door_bytes=lambda: (0, 0), poll_s: float = POLL_S):
    """`door_bytes()`: (sample bytes taken, weight bytes sent) by this process's door so far, told to the others
    each poll (`intake_door_kib/P`, `intake_weight_kib/P`)."""
    self.queue, self.functions, self.poll_s, self.door_bytes = queue, reward_functions, poll_s, door_bytes
    self.process, self.processes = jax.process_index(), jax.process_count()
    self._ready: list[SampleShard] = []
    self.counters = IntakeCounters()
    self.door_kib = {f"intake_{kind}_kib/{p}": 0 for kind in ("door", "weight") for p in range(self.processes)}

  def get(self, timeout: float) -> SampleShard:
    """The next shard of the shared view; TimeoutError when none arrived anywhere within about `timeout`."""
    polls = max(1, int(round(timeout / self.poll_s)))
    while not self._ready and polls:
      self._exchange(self._local(), stop=False)
      polls -= 1
    if not self._ready:
      raise TimeoutError("no samples arrived at any trainer process")
    return self._ready.pop(0)

  def row(self) -> dict:
    """Its counters and each process's door and weight KiB at the last poll, as metric entries."""
    return {**self.counters, **self.door_kib}

  def stop(self) -> None:
    """Process 0: the others' next poll tells them to stop (`IntakeStopped`); process 0 itself goes on to raise
    what stopped it."""
    try:
      self._exchange(None, stop=True)
    except IntakeStopped:
      pass

  def _local(self) -> SampleShard | None:
    """What arrived at this process's door: waits up to `poll_s` for the first shard, then takes what is there."""
    shards = []
    try:
      shards.append(self.queue.get(timeout=self.poll_s))
      while True:
        shards.append(self.queue.get(timeout=0))
    except (TimeoutError, QueueClosed):
      pass
    return SampleShard.concat(shards) if shards else None

  def _exchange(self, local: SampleShard | None, stop: bool) -> None:
    """One poll: every process's rows described to every process; the shared view's shards queued."""
    self.counters.intake_polls += 1
    blob = describe(local, self.process) if local is not None else np.zeros(0, np.uint8)
    gather = launch.launcher(jax.devices())  # multihost_utils' collectives run over every device
    samples, weights = self.door_bytes()
    mine = np.asarray([blob.size, int(stop), samples >> 10, weights >> 10], np.int32)
    head = np.asarray(gather(multihost_utils.process_allgather, mine))
    for p in range(self.processes):
      self.door_kib.update({f"intake_door_kib/{p}": int(head[p, 2]), f"intake_weight_kib/{p}": int(head[p, 3])})
    if head[0, 1]:
      raise IntakeStopped("trainer process 0 stopped taking samples")
    if not head[:, 0].any():
      return
    padded = np.zeros(_bucket(int(head[:, 0].max())), np.uint8)  # few sizes: each is a compile of the all-gather
    padded[:blob.size] = blob
    blobs = np.asarray(gather(multihost_utils.process_allgather, padded))
    rows = [read_description(blobs[p, :head[p, 0]], self.functions) for p in range(self.processes)]
    self.counters.intake_description_bytes += int(head[:, 0].sum())
    self.counters.intake_peer_description_bytes += int(head[:, 0].sum() - head[self.process, 0])  # received
    self.counters.intake_local_samples += 0 if local is None else local.num_samples
    view = shared_view(rows, local, self.process)
    self.counters.intake_samples += view.num_samples
    self._ready.extend(split_by_step(view))


def _bucket(size: int) -> int:
  """A blob's all-gathered size: the next power of two from 1 KiB."""
  return max(1024, 1 << (size - 1).bit_length())


def describe(shard: SampleShard, process: int) -> np.ndarray:
  """`shard`'s rows without their tokens, as compressed bytes: ints (`INTS`, token stats, lengths, `process`), then
  floats (reward, reward parts)."""
  n = shard.num_samples
  ints = np.concatenate([np.stack([getattr(shard, k) for k in INTS], axis=1).astype(np.int64),
                         shard.stats, shard.valid.sum(axis=1, keepdims=True),
                         np.full((n, 1), process)], axis=1).astype("<i8")
  floats = np.concatenate([shard.rewards[:, None], shard.reward_parts], axis=1).astype("<f4")  # as the shard holds them
  raw = np.concatenate([ints.view(np.uint8).ravel(), floats.view(np.uint8).ravel()]).tobytes()
  return np.frombuffer(zlib.compress(raw, 1), np.uint8)  # small integers in wide columns: a few bytes a row


def read_description(blob: np.ndarray, functions: int) -> dict:
  """`describe`'s rows back as arrays (an empty blob: no rows)."""
  blob = np.frombuffer(zlib.decompress(blob.tobytes()), np.uint8) if blob.size else blob
  columns = len(INTS) + len(STATS) + 2
  n = blob.size // (ROW_BYTES + 4 * functions)
  ints = blob[:8 * n * columns].view("<i8").reshape(n, columns)
  floats = blob[ints.nbytes:].view("<f4").reshape(n, 1 + functions)
  out = {k: ints[:, i] for i, k in enumerate(INTS)}
  out.update(token_stats=ints[:, len(INTS):len(INTS) + len(STATS)], lengths=ints[:, -2], owners=ints[:, -1],
             rewards=floats[:, 0], reward_parts=floats[:, 1:])
  return out


def shared_view(rows: list[dict], local: SampleShard | None, process: int) -> SampleShard:
  """One shard of every process's rows, by step, and in a step interleaved (each process's first row, then each
  one's second, ...) so that a trainer call holds rows of every process; the tokens of this process's own rows, zeros
  in the others'."""
  order = sorted(((i, p) for p, r in enumerate(rows) for i in range(len(r["steps"]))),
                 key=lambda ip: (int(rows[ip[1]]["steps"][ip[0]]), ip[0], ip[1]))
  width = max(int(max(r["lengths"].max(initial=0) for r in rows)), 1)
  total = len(order)
  tokens = {k: np.zeros((total, width), dtype) for k, dtype in
            (("tokens", np.int32), ("loss_mask", np.bool_), ("logprobs", np.float32), ("versions", np.int64))}
  fields = {k: np.concatenate([rows[p][k][i:i + 1] for i, p in order]) for k in rows[0] if k != "lengths"}
  lengths = np.asarray([rows[p]["lengths"][i] for i, p in order])
  for at, (i, p) in enumerate(order):
    if p == process:
      for k in tokens:
        tokens[k][at, :lengths[at]] = getattr(local, k)[i, :lengths[at]]
  valid = np.arange(width)[None] < lengths[:, None]
  return SampleShard(valid=valid, **tokens, **fields)


def split_by_step(view: SampleShard) -> list[SampleShard]:
  """The view's rows as shards of one step each, a new shard wherever a sample's key comes again (a sample sent
  twice is then seen twice, as by a trainer of one process)."""
  out, start, seen = [], 0, set()
  keys = view.keys()
  for i, key in enumerate(keys):
    if key in seen or (i > start and view.steps[i] != view.steps[start]):
      out.append(view.take(np.arange(start, i)))
      start, seen = i, set()
    seen.add(key)
  if keys:
    out.append(view.take(np.arange(start, len(keys))))
  return out
