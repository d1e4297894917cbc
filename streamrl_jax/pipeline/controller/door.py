"""The door's check of an arriving `SampleShard`: one step a shard, and whole groups (each sample index of a
group once); the controller's `Door` then takes only groups of leases the sender was given. Taken groups are
remembered until their step is summarised, so a lease handed back is cut to the groups still missing."""

from __future__ import annotations

import threading
import time

import numpy as np

from streamrl_jax.messages import BadShard, Delivery, DeliveryStatus, quote, row_step


def shard_groups(shard, group_size: int) -> tuple[int, dict[int, float]]:
  """(the shard's step, {group id: mean completion length}); `BadShard` names the first broken rule."""
  step = int(shard.steps[0])
  if (shard.steps != step).any():
    steps = [row_step(s) for s in sorted(set(shard.steps.tolist()))[:4]]
    raise BadShard(f"a shard mixes steps {steps}; send one step a shard")
  completion = shard.loss_mask.sum(axis=1)
  lengths = {}
  for g in np.unique(shard.group_ids):
    rows = shard.group_ids == g
    if sorted(shard.sample_indices[rows].tolist()) != list(range(group_size)):
      raise BadShard(f"group {int(g)} of step {row_step(step)} carries sample indices "
                     f"{quote(sorted(shard.sample_indices[rows].tolist()))}; a shard carries whole groups, "
                     f"indices 0..{group_size - 1} once each")
    lengths[int(g)] = float(completion[rows].mean())
  return step, lengths


class Door:
  """The controller's judgement of the sample batches that arrive at the trainer's doors (its own Flight server's,
  and as `Delivery` messages those of the trainer's other processes), under the controller's lock."""

  def __init__(self, group_size: int, roster, leases, plans, timeline, lock: threading.Condition):
    self.group_size, self.roster, self.leases, self.plans, self.timeline = group_size, roster, leases, plans, timeline
    self._cond = lock

  def on_shard(self, sampler_id: int, shard) -> str:
    """Whether to take a `SampleShard` from `sampler_id`: 'accept' (a live sampler), 'late' (a lost one: taken,
    the trainer drops copies it has), 'trained' (its step is trained already: not taken) or 'rejoin' (unknown
    here: refused, register again). `BadShard` for a shard that breaks the rules (`shard_groups`)."""
    step, lengths = shard_groups(shard, self.group_size)
    return self._judge(sampler_id, step, lengths)

  def deliver(self, message: Delivery) -> DeliveryStatus:
    """`on_shard` for a batch that arrived at another trainer process's door: its groups' ids and lengths alone."""
    try:
      return DeliveryStatus(self._judge(message.sampler_id, message.step,
                                        dict(zip(message.group_ids, message.lengths))))
    except BadShard as err:
      self.shard_refused(str(err))
      return DeliveryStatus("refused", str(err)[:500])

  def _judge(self, sampler_id: int, step: int, lengths: dict[int, float]) -> str:
    with self._cond:
      if sampler_id not in self.roster and not self.roster.is_lost(sampler_id):
        self.timeline.count(rejoin_requests=1)
        return "rejoin"
      if step < self.plans.version:  # published version v: steps below v are trained
        self.timeline.count(trained_refusals=1)
        return "trained"
      foreign = self.leases.foreign(sampler_id, step, lengths)
      if foreign:
        raise BadShard(f"group {foreign[0]} of step {row_step(step)} was never leased to sampler "
                       f"{quote(self.roster.name_of(sampler_id))}")
      self.plans.delivered(step, lengths)
      if self.roster.is_lost(sampler_id):
        self.timeline.count(late_samples=len(lengths) * self.group_size)
        return "late"
      self.roster.heard(sampler_id)
      for when, lost_sampler in self.leases.first_deliveries(step, lengths):  # what a loss handed back
        self.timeline.event("re_leased_delivered", sampler=self.roster.name_of(sampler_id), step=step,
                            lost_sampler=lost_sampler, since_lost_s=round(time.time() - when, 3))
      return "accept"

  def shard_refused(self, reason: str) -> None:
    """The door refused a sample batch (malformed, or outside the sender's leases): an event, a count."""
    with self._cond:
      self.timeline.count(refused_batches=1)
      self.timeline.event("shard_refused", reason=reason[:300])
