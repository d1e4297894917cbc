"""Advantage estimators: pure functions over rewards of finished samples, registered by name.

Sequence-level estimators take rewards [N] and group ids [N] and return one advantage per sequence;
the train step broadcasts it over the sequence's completion tokens. GAE works per token.
"""

from __future__ import annotations

import numpy as np

from streamrl_jax.registry import Registry

ADVANTAGES = Registry("advantage estimator")
EPS = 1e-6


def _group_stats(rewards, group_ids):
  """Per-sequence group mean, group std (population) and group size."""
  rewards = np.asarray(rewards, np.float64)
  _, inverse, counts = np.unique(np.asarray(group_ids), return_inverse=True, return_counts=True)
  sums = np.bincount(inverse, rewards)
  means = sums / counts
  var = np.bincount(inverse, (rewards - means[inverse]) ** 2) / counts
  return means[inverse], np.sqrt(var)[inverse], counts[inverse]


def _require_groups(counts, name):
  if np.any(counts < 2):
    raise ValueError(f"{name} needs at least 2 samples per group (GRPO group size 1 has no baseline)")


@ADVANTAGES.register("grpo")
def grpo(rewards, group_ids):
  """(r - group mean) / (group std + eps)."""
  mean, std, counts = _group_stats(rewards, group_ids)
  _require_groups(counts, "grpo")
  return ((np.asarray(rewards) - mean) / (std + EPS)).astype(np.float32)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards, group_ids):
  """Dr. GRPO: r - group mean, no division by the std."""
  mean, _, counts = _group_stats(rewards, group_ids)
  _require_groups(counts, "dr_grpo")
  return (np.asarray(rewards) - mean).astype(np.float32)


@ADVANTAGES.register("rloo")
def rloo(rewards, group_ids):
  """Leave-one-out: r - mean of the other samples of the group = n/(n-1) (r - group mean)."""
  mean, _, counts = _group_stats(rewards, group_ids)
  _require_groups(counts, "rloo")
  return (counts / (counts - 1) * (np.asarray(rewards) - mean)).astype(np.float32)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards, group_ids):
  """REINFORCE++: rewards normalised over the whole batch (group ids unused)."""
  rewards = np.asarray(rewards, np.float64)
  return ((rewards - rewards.mean()) / (rewards.std() + EPS)).astype(np.float32)


@ADVANTAGES.register("gae")
def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
  """Generalised advantage estimation per token, on the host; rewards, values, mask [B, T] (mask: completion tokens,
  contiguous). Returns (advantages, returns) [B, T] float32, zero outside the mask."""
  rewards, values, mask = (np.asarray(x, np.float32) for x in (rewards, values, mask))
  next_values = np.concatenate([values[:, 1:] * mask[:, 1:], np.zeros_like(values[:, :1])], axis=1)
  deltas = (rewards + gamma * next_values - values) * mask
  advantages, carry = np.zeros_like(deltas), np.zeros(len(deltas), np.float32)
  for t in range(deltas.shape[1] - 1, -1, -1):  # back from the last token: T steps, each over every row
    carry = deltas[:, t] + np.float32(gamma * lam) * carry * mask[:, t]
    advantages[:, t] = carry
  advantages *= mask
  return advantages, (advantages + values) * mask


SEQUENCE_LEVEL = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def compute_advantages(name: str, rewards, group_ids) -> np.ndarray:
  """One advantage per sequence with a sequence-level estimator (GAE needs values: call `gae`)."""
  fn = ADVANTAGES.get(name)
  if name not in SEQUENCE_LEVEL:
    raise ValueError(f"{name!r} is token-level and needs a critic's values; call it directly")
  return fn(rewards, group_ids)
