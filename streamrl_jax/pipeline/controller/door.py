"""The door's check of an arriving `SampleShard`: one step a shard, and whole groups (each sample index of a
group once); the controller then takes only groups of leases the sender was given. Taken groups are
remembered until their step is summarised, so a lease handed back is cut to the groups still missing."""

from __future__ import annotations

import numpy as np

from streamrl_jax.messages import BadShard, quote


def shard_groups(shard, group_size: int) -> tuple[int, dict[int, float]]:
  """(the shard's step, {group id: mean completion length}); `BadShard` names the first broken rule."""
  step = int(shard.steps[0])
  if (shard.steps != step).any():
    raise BadShard(f"a shard mixes steps {sorted(set(shard.steps.tolist()))[:4]}; send one step a shard")
  completion = shard.loss_mask.sum(axis=1)
  lengths = {}
  for g in np.unique(shard.group_ids):
    rows = shard.group_ids == g
    if sorted(shard.sample_indices[rows].tolist()) != list(range(group_size)):
      raise BadShard(f"group {int(g)} of step {step} carries sample indices "
                     f"{quote(sorted(shard.sample_indices[rows].tolist()))}; a shard carries whole groups, "
                     f"indices 0..{group_size - 1} once each")
    lengths[int(g)] = float(completion[rows].mean())
  return step, lengths
