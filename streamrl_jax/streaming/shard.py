"""`SampleShard`: finished samples as numpy arrays plus the policy versions that produced them.

Across processes the same record travels as an Arrow record batch (`streaming.sample_schema`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

ROW_FIELDS = {"rewards": np.float32, "group_ids": np.int64, "sample_indices": np.int64,
              "steps": np.int64, "first_versions": np.int64, "last_versions": np.int64, "reward_errors": np.int32,
              "reward_timeouts": np.int32}
PART_FIELDS = {"reward_parts": np.float32}  # [n, reward functions]
TOKEN_FIELDS = {"tokens": np.int32, "valid": np.bool_, "loss_mask": np.bool_, "logprobs": np.float32,
                "versions": np.int64}
# Held beside a shard, never on the wire: the trainer process that holds each sample's tokens, and what the metrics
# and the step's decisions read of them (`token_stats`), so that a process that holds a sample's row but not its tokens
# (a trainer of several processes) decides as the one that does.
STATS = ("trained", "version_sum", "version_min", "env")  # token_stats' columns, one row per sample
NO_VERSION = np.iinfo(np.int64).max  # version_min of a sample with no trained token
ROUTES_DTYPE = np.int16  # a token's experts + 1 at each sparse layer: up to 32,766 experts


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
  A mixture of experts' samples carry `routes` [n, L, sparse layers, k]: the experts the sampler routed each token
  to, plus one (0: not recorded, as for padding and a completion's last token, which no step read).
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
  owners: np.ndarray | None = None  # [n] the trainer process holding each sample's tokens; default: 0
  token_stats: np.ndarray | None = None  # [n, len(STATS)]; default: counted from the tokens
  routes: np.ndarray | None = None  # [n, L, sparse layers, k] int16, expert + 1 (0: none); None: a dense model's

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
    owners = np.zeros(n, np.int32) if self.owners is None else np.asarray(self.owners, np.int32)
    if owners.shape != (n,):
      raise ValueError(f"SampleShard.owners has shape {owners.shape}, expected ({n},)")
    object.__setattr__(self, "owners", owners)
    if self.routes is not None:
      routes = np.asarray(self.routes)
      if routes.ndim != 4 or routes.shape[:2] != (n, length) or routes.dtype != ROUTES_DTYPE:
        raise ValueError(f"SampleShard.routes has shape {routes.shape} ({routes.dtype}), expected ({n}, {length}, "
                         f"layers, k) int16")
      object.__setattr__(self, "routes", routes)
    if self.token_stats is not None:  # given: rows whose tokens another process holds
      stats = np.asarray(self.token_stats, np.int64)
      if stats.shape != (n, len(STATS)):
        raise ValueError(f"SampleShard.token_stats has shape {stats.shape}, expected ({n}, {len(STATS)})")
      object.__setattr__(self, "token_stats", stats)

  @functools.cached_property
  def stats(self) -> np.ndarray:
    """[n, len(STATS)]: `token_stats` when given, else counted from the tokens (so a `dataclasses.replace` of the
    tokens counts them afresh)."""
    return self.token_stats if self.token_stats is not None else _token_stats(self)

  @property
  def num_samples(self) -> int:
    return len(self.tokens)

  @property
  def trained_tokens(self) -> int:
    """Completion tokens that carry a loss (0: nothing of this shard is trained)."""
    return int(self.stats[:, 0].sum())

  @property
  def min_version(self) -> int:
    return int(self.first_versions.min()) if len(self.first_versions) else 0

  def staleness_sum_max(self, step: int) -> tuple[int, int, int]:
    """(trained tokens, the sum and the most of step - version over them): how many updates behind they are."""
    trained, version_sum, version_min = (self.stats[:, i] for i in range(3))
    some = trained > 0
    most = int(step - version_min[some].min()) if some.any() else 0
    return int(trained.sum()), int(step * trained.sum() - version_sum.sum()), most

  @property
  def env_tokens(self) -> int:
    """Tokens an environment wrote into the completions (masked, after a row's first trained token)."""
    return int(self.stats[:, 3].sum())

  @classmethod
  def concat(cls, shards: list[SampleShard]) -> SampleShard:
    width = max(s.tokens.shape[1] for s in shards)
    pad = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])))  # noqa: E731
    fields = {k: np.concatenate([pad(getattr(s, k)) for s in shards]) for k in TOKEN_FIELDS}
    fields.update({k: np.concatenate([getattr(s, k) for s in shards]) for k in {**ROW_FIELDS, **PART_FIELDS}})
    fields["owners"] = np.concatenate([s.owners for s in shards])
    routed = [s.routes for s in shards if s.routes is not None]
    if routed:  # a shard without routes (samples from elsewhere) holds none: zeros
      fields["routes"] = np.concatenate([
          np.pad(s.routes, ((0, 0), (0, width - s.routes.shape[1]), (0, 0), (0, 0))) if s.routes is not None else
          np.zeros((s.num_samples, width) + routed[0].shape[2:], ROUTES_DTYPE) for s in shards])
    if any(s.token_stats is not None for s in shards):
      fields["token_stats"] = np.concatenate([s.stats for s in shards])
    return cls(**fields)

  def take(self, rows) -> SampleShard:
    """The samples at `rows` (indices), in that order."""
    rows = np.asarray(rows, np.int64)
    given = {} if self.token_stats is None else {"token_stats": self.token_stats[rows]}
    if self.routes is not None:
      given["routes"] = self.routes[rows]
    return SampleShard(**{k: getattr(self, k)[rows] for k in {**TOKEN_FIELDS, **ROW_FIELDS, **PART_FIELDS}},
                       owners=self.owners[rows], **given)

  def keys(self) -> list[tuple[int, int, int]]:
    """(step, group id, sample index) of every sample: what identifies it whoever generated it."""
    return list(zip(self.steps.tolist(), self.group_ids.tolist(), self.sample_indices.tolist()))

  def train_batch(self, advantages: np.ndarray, owned: bool = False, step: int | None = None) -> dict:
    """The micro-batch dict the trainer takes, with one advantage per sample; `owned`: with each token's `owners`
    (the process that holds it, for a trainer of several processes); `step` (the version the trainer holds): with
    `stale`, the completion tokens older weights sampled."""
    batch = dict(tokens=self.tokens, valid=self.valid, loss_mask=self.loss_mask, logprobs=self.logprobs,
                 advantages=np.asarray(advantages, np.float32))
    if step is not None:
      batch["stale"] = self.loss_mask & (self.versions < step)
    if owned:
      batch["owners"] = np.repeat(self.owners[:, None], self.tokens.shape[1], axis=1)
    if self.routes is not None:
      batch["routes"] = self.routes
    return batch


def _token_stats(shard: SampleShard) -> np.ndarray:
  """`STATS` of each sample of `shard`, counted from its tokens."""
  mask = shard.loss_mask
  trained = mask.sum(axis=1)
  version_sum = np.where(mask, shard.versions, 0).sum(axis=1)
  version_min = np.where(mask, shard.versions, NO_VERSION).min(axis=1, initial=NO_VERSION)
  pos = np.arange(mask.shape[1])[None]
  first = np.where(mask.any(axis=1), mask.argmax(axis=1), mask.shape[1])[:, None]
  env = np.sum(shard.valid & ~mask & (pos >= first), axis=1)
  return np.stack([trained, version_sum, version_min, env], axis=1).astype(np.int64)

