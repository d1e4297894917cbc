"""`SampleShard`: finished samples as numpy arrays plus the policy versions that produced them.

Across processes the same record travels as an Arrow record batch (`streaming.sample_schema`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROW_FIELDS = {"rewards": np.float32, "group_ids": np.int64, "sample_indices": np.int64,
              "steps": np.int64, "first_versions": np.int64, "last_versions": np.int64, "reward_errors": np.int32,
              "reward_timeouts": np.int32}
PART_FIELDS = {"reward_parts": np.float32}  # [n, reward functions]
TOKEN_FIELDS = {"tokens": np.int32, "valid": np.bool_, "loss_mask": np.bool_, "logprobs": np.float32,
                "versions": np.int64}


@dataclasses.dataclass(frozen=True)
class SampleShard:
  """n finished samples, right-padded to a common length L.

  tokens [n, L] hold prompt then completion; `valid` marks real tokens, `loss_mask` completion tokens;
  logprobs [n, L] is the sampler's log-probability of each completion token (0 elsewhere), and
  versions [n, L] the policy version that sampled it (0 elsewhere; when not given, every completion
  token is taken to be of its sample's first version). first_versions and last_versions are the oldest and
  newest of a sample's token versions. A sample is keyed by (step, group id, sample index): the RL step it was generated for, its prompt's
  group, and its place in the group. reward_parts [n, k] holds each reward function's value (`rewards` is their
  weighted sum, plus an environment's), reward_errors and reward_timeouts how many of its calls failed (scored 0).
  """

  tokens: np.ndarray
  valid: np.ndarray
  loss_mask: np.ndarray
  logprobs: np.ndarray
  rewards: np.ndarray
  group_ids: np.ndarray
  sample_indices: np.ndarray
  steps: np.ndarray
  first_versions: np.ndarray
  last_versions: np.ndarray
  versions: np.ndarray | None = None
  reward_parts: np.ndarray | None = None  # default: the reward alone, one column
  reward_errors: np.ndarray | None = None  # default: none
  reward_timeouts: np.ndarray | None = None

  def __post_init__(self):
    n, length = np.shape(self.tokens)
    if self.reward_parts is None:
      object.__setattr__(self, "reward_parts", np.asarray(self.rewards, np.float32).reshape(n, 1))
    for name in ("reward_errors", "reward_timeouts"):
      if getattr(self, name) is None:
        object.__setattr__(self, name, np.zeros(n, np.int32))
    parts = np.asarray(self.reward_parts, np.float32)
    if parts.ndim != 2 or len(parts) != n:
      raise ValueError(f"SampleShard.reward_parts has shape {parts.shape}, expected ({n}, functions)")
    object.__setattr__(self, "reward_parts", parts)
    if self.versions is None:
      if not np.array_equal(self.first_versions, self.last_versions):
        raise ValueError("SampleShard.versions must be given when a sample's tokens are of several versions")
      first = np.asarray(self.first_versions, np.int64).reshape(-1, 1)
      object.__setattr__(self, "versions", np.where(np.asarray(self.loss_mask, bool), first, 0))
    for name, dtype in {**TOKEN_FIELDS, **ROW_FIELDS}.items():
      value = np.asarray(getattr(self, name), dtype)
      expected = (n, length) if name in TOKEN_FIELDS else (n,)
      if value.shape != expected:
        raise ValueError(f"SampleShard.{name} has shape {value.shape}, expected {expected}")
      object.__setattr__(self, name, value)
    if np.any(self.loss_mask & ~self.valid):
      raise ValueError("SampleShard.loss_mask marks tokens that are not valid")

  @property
  def num_samples(self) -> int:
    return len(self.tokens)

  @property
  def trained_tokens(self) -> int:
    """Completion tokens that carry a loss (0: nothing of this shard is trained)."""
    return int(np.count_nonzero(self.loss_mask))

  @property
  def min_version(self) -> int:
    return int(self.first_versions.min()) if len(self.first_versions) else 0

  def token_staleness(self, step: int) -> np.ndarray:
    """step - version of every completion token, flat: how many updates behind each trained token is."""
    return step - self.versions[self.loss_mask]

  @classmethod
  def concat(cls, shards: list[SampleShard]) -> SampleShard:
    width = max(s.tokens.shape[1] for s in shards)
    pad = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])))  # noqa: E731
    fields = {k: np.concatenate([pad(getattr(s, k)) for s in shards]) for k in TOKEN_FIELDS}
    fields.update({k: np.concatenate([getattr(s, k) for s in shards]) for k in {**ROW_FIELDS, **PART_FIELDS}})
    return cls(**fields)

  def take(self, rows) -> SampleShard:
    """The samples at `rows` (indices), in that order."""
    rows = np.asarray(rows, np.int64)
    return SampleShard(**{k: getattr(self, k)[rows] for k in {**TOKEN_FIELDS, **ROW_FIELDS, **PART_FIELDS}})

  def keys(self) -> list[tuple[int, int, int]]:
    """(step, group id, sample index) of every sample: what identifies it whoever generated it."""
    return list(zip(self.steps.tolist(), self.group_ids.tolist(), self.sample_indices.tolist()))

  def train_batch(self, advantages: np.ndarray) -> dict:
    """The micro-batch dict the trainer takes, with one advantage per sample."""
    return dict(tokens=self.tokens, valid=self.valid, loss_mask=self.loss_mask, logprobs=self.logprobs,
                advantages=np.asarray(advantages, np.float32))

