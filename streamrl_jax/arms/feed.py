"""The fan-out of the lead's sample stream to follower arms: each follower's bounded `ArmFeed`, the lead's
`Fanout` that offers every shard to every feed without ever waiting, and a follower's `FollowerSource`.

A feed that is full refuses the shard and drops that whole step for that follower (a follower trains whole steps
or none): the follower learns it from the feed. A follower more than `arm_max_lag` steps behind
the lead skips the step it is at. Both are counted, never silent: every sample offered to a follower is trained
by it or counted in `arm_samples_skipped`, and every step it does not train in `arm_steps_skipped`.

The fan-out writes a feed from the lead's thread and the follower reads it from its own; all they share is the
feed, whose state changes under its lock only.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

from streamrl_jax.counters import Counters
from streamrl_jax.messages import StepSkipped, row_step
from streamrl_jax.records.metric_table import ARMS
from streamrl_jax.streaming import QueueClosed, SampleShard


class ArmFeed:
  """One follower's inbox of shards, at most `capacity` samples; with what it knows of the lead (steps the lead
  has trained, steps dropped from this feed). One writer (the fan-out), one reader: a follower in this program
  (`get` takes a shard out), or with `retain` a follower program across Flight (`read` from a sequence number on,
  `acknowledge` the steps it has checkpointed: only then are their shards let go, so a follower that restarts
  reads again whatever it had not saved)."""

  def __init__(self, capacity: int, retain: bool = False):
    if capacity < 1:
      raise ValueError(f"ArmFeed capacity must be >= 1 sample, got {capacity}")
    self.capacity, self.retain = capacity, retain
    self._items: collections.deque[tuple[int, SampleShard]] = collections.deque()  # (sequence number, shard)
    self._samples, self._closed, self._lead_done, self._seq = 0, False, 0, 0
    self._dropped: set[int] = set()
    self._cond = threading.Condition()
    self._stats = dict(offered_samples=0, refused_samples=0, discarded_samples=0, max_depth=0)

  def offer(self, shard: SampleShard) -> bool:
    """Enqueues `shard` if it fits, now (nothing waits). A shard that does not fit drops its step: it and every
    later shard of that step are refused (counted), so the follower never trains half a step."""
    step = int(shard.steps[0])
    with self._cond:
      self._stats["offered_samples"] += shard.num_samples
      if self._closed or step in self._dropped or self._samples + shard.num_samples > self.capacity:
        self._stats["refused_samples"] += shard.num_samples
        if not self._closed:
          self._dropped.add(step)
          self._cond.notify_all()
        return False
      self._items.append((self._seq, shard))
      self._seq += 1
      self._samples += shard.num_samples
      self._stats["max_depth"] = max(self._stats["max_depth"], self._samples)
      self._cond.notify_all()
      return True

  def mark_dropped(self, steps) -> None:
    """Steps that will not reach this follower whole (a follower program learns them from the lead's feed)."""
    with self._cond:
      self._dropped.update(steps)
      self._cond.notify_all()

  def read(self, after: int, timeout: float) -> list[tuple[int, SampleShard]]:
    """Retained shards numbered above `after`, waiting up to `timeout` s for one ([] then, or once closed)."""
    with self._cond:
      self._cond.wait_for(lambda: self._closed or (self._items and self._items[-1][0] > after), timeout)
      return [(seq, shard) for seq, shard in self._items if seq > after]

  def wait_empty(self, timeout: float) -> bool:
    """Whether the feed holds nothing, waiting up to `timeout` s for it to."""
    with self._cond:
      return self._cond.wait_for(lambda: not self._items, timeout)

  def acknowledge(self, checkpointed: int) -> None:
    """The follower has saved every step below `checkpointed`: their retained shards go."""
    with self._cond:
      kept = collections.deque(item for item in self._items if int(item[1].steps[0]) >= checkpointed)
      self._samples = sum(shard.num_samples for _, shard in kept)
      self._items = kept
      self._cond.notify_all()

  def lead_trained(self, steps_done: int) -> None:
    """The lead has trained every step below `steps_done`."""
    with self._cond:
      self._lead_done = max(self._lead_done, steps_done)
      self._cond.notify_all()

  def get(self, timeout: float, step: int) -> SampleShard:
    """The next shard; raises `StepSkipped` as soon as `step` is dropped, TimeoutError after `timeout` s, and
    QueueClosed once closed and drained."""
    with self._cond:
      ready = self._cond.wait_for(lambda: self._items or self._closed or step in self._dropped, timeout)
      if step in self._dropped:
        raise StepSkipped(step, "the follower's feed was full")
      if not ready:
        raise TimeoutError(f"no shard for {timeout} s")
      if not self._items:
        raise QueueClosed("the lead's stream ended")
      _, shard = self._items.popleft()
      self._samples -= shard.num_samples
      self._cond.notify_all()
      return shard

  def view(self) -> tuple[int, frozenset]:
    """(steps the lead has trained, steps dropped from this feed)."""
    with self._cond:
      return self._lead_done, frozenset(self._dropped)

  def close(self, discard: bool = False) -> None:
    """No more offers; with `discard`, what is queued is thrown away too (a stop: followers end at their step)."""
    with self._cond:
      self._closed = True
      if discard:
        self._stats["discarded_samples"] += self._samples
        self._items.clear()
        self._samples = 0
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    with self._cond:
      return self._closed

  def stats(self) -> dict:
    with self._cond:
      return dict(self._stats, depth=self._samples)


class Fanout:
  """The lead's side: `offer` every shard the lead receives to every feed, `lead_trained` after each of the lead's
  steps; `tap` wraps the lead's shard source and `lead_part` is a part of the lead's rows, to do both. Owned by the
  lead's thread; it keeps nothing itself."""

  def __init__(self, feeds: dict[str, ArmFeed], lead_name: str = "lead"):
    self.feeds, self.lead_name = feeds, lead_name

  def tap(self, get_shard: Callable[[float], SampleShard]) -> Callable[[float], SampleShard]:
    """The lead's `get_shard`, offering every shard to the followers as the lead takes it."""
    def get(timeout: float) -> SampleShard:
      shard = get_shard(timeout)
      self.offer(shard)
      return shard
    return get

  def lead_part(self, row: dict) -> dict:
    """The lead's row part (`metric_table.join_row`): its arm's name and its own policy divergence; the feeds learn
    its progress from the row."""
    self.lead_trained(row["step"])
    return {ARMS: dict(arm=self.lead_name, arm_policy_divergence=row.get("logprob_mismatch_kl", 0.0))}

  def offer(self, shard: SampleShard) -> None:
    for feed in self.feeds.values():
      feed.offer(shard)

  def lead_trained(self, steps_done: int) -> None:
    for feed in self.feeds.values():
      feed.lead_trained(steps_done)

  def close(self, discard: bool = False) -> None:
    for feed in self.feeds.values():
      feed.close(discard)


@dataclasses.dataclass(slots=True, eq=False)
class SkipCounters(Counters):
  """A follower's steps skipped (it fell behind) and their samples."""

  arm_steps_skipped: int = 0
  arm_samples_skipped: int = 0


class FollowerSource:
  """A follower's shard source and skip rule over its feed (the follower's thread only). Steps before
  `first_step` (the lead started later: a resume) are skipped; so is a step dropped from the feed, and a step the
  follower reaches more than `max_lag` steps behind the lead. Shards of skipped steps are thrown away, counted."""

  def __init__(self, feed: ArmFeed, max_lag: int, first_step: int):
    self.feed, self.max_lag, self.first_step = feed, max_lag, first_step
    self.step = first_step
    self.skipped: set[int] = set()
    self._handed: dict[int, int] = {}  # samples handed to the follower, per step not yet skipped
    self.counters = SkipCounters()

  def lag(self, step: int) -> int:
    """Steps the lead has trained beyond `step`."""
    return max(0, self.feed.view()[0] - step)

  def skip(self, step: int) -> str | None:
    """Why step `step` is not trained (None: it is); called as the follower begins it."""
    self.step = step
    lead_done, dropped = self.feed.view()
    why = None
    if step < self.first_step:
      why = f"the lead's stream starts at step {row_step(self.first_step)}"
    elif step in dropped:
      why = "the follower's feed was full"
    elif lead_done - step > self.max_lag:
      why = f"{lead_done - step} steps behind the lead (ArmsConfig.max_lag={self.max_lag})"
    if why is not None:
      self.mark_skipped(step)
    return why

  def mark_skipped(self, step: int) -> None:
    """Step `step` is not trained: the samples of it handed out already are counted as skipped."""
    self.skipped.add(step)
    self.counters.arm_steps_skipped += 1
    self.counters.arm_samples_skipped += self._handed.pop(step, 0)

  def get(self, timeout: float) -> SampleShard:
    """The next shard of a step not skipped (`StepSkipped` when the current one is dropped meanwhile)."""
    while True:
      try:
        shard = self.feed.get(timeout, self.step)
      except StepSkipped as skipped:
        self.mark_skipped(skipped.step)
        raise
      step = int(shard.steps[0])
      if step in self.skipped:
        self.counters.arm_samples_skipped += shard.num_samples
        continue
      self._handed[step] = self._handed.get(step, 0) + shard.num_samples
      return shard

  def trained(self, step: int) -> None:
    """Step `step` is trained: its samples are the follower's counters' now."""
    self._handed.pop(step, None)
