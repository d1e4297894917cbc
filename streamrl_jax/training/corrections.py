"""Off-policy corrections: how much a token sampled by another policy counts in the loss.

Every part reads the behaviour log-ratio r = log pi_old - log mu of each completion token (pi_old the trainer's policy
the surrogate compares with, mu the sampler's) and returns a weight (stop-gradient: it scales the token's surrogate)
and a keep mask (a rejected token leaves the loss, its denominator included). Parts compose: weights multiply,
masks intersect (`correct`). Levels:

- token: each token's own ratio exp(r_t);
- sequence: the product of a sequence's token ratios, exp(sum_t r_t);
- geometric: their geometric mean, exp(mean_t r_t).

`*_tis` truncate the weight at `ObjectiveConfig.tis_cap`; `*_mask` reject tokens (or whole sequences) whose ratio
leaves [mask_low, mask_high]; `icepop` rejects tokens whose ratio leaves [1/icepop_k, icepop_k]; `veto` rejects a
sequence holding any token ratio below `veto_floor`. Weights are computed in log space (a long sequence's product
never overflows).

A sequence is a row, or with `segment_ids` (packed rows) each nonzero id of a row. Packing never splits a sample
(`packing.pack_plan`) and a trainer call takes whole rows, so every sequence-level quantity is computed in the one
call that holds the whole sequence: streamed accumulation stays exact.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from streamrl_jax.registry import Registry

CORRECTIONS = Registry("off-policy correction")
sg = jax.lax.stop_gradient
HISTOGRAM_EDGE = 2.0  # the behaviour log-ratio histogram spans [-2, 2] (ratios 0.135 to 7.39), beyond: two end bins
HISTOGRAM_BINS = 129  # odd: a bin centred on log-ratio 0 (a ratio of 1 reads as 1)


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
  """The numbers the corrections `ObjectiveConfig.correction` names read."""

  tis_cap: float = 2.0  # *_tis: the importance weight is truncated at this value
  mask_low: float = 0.5  # *_mask: tokens (sequences) whose ratio is below this are rejected
  mask_high: float = 2.0  # *_mask: ... or above this
  icepop_k: float = 2.0  # icepop: tokens whose ratio leaves [1/k, k] are rejected
  veto_floor: float = 1e-4  # veto: a sequence holding a token ratio below this is rejected

  def __post_init__(self):
    for name in ("tis_cap", "icepop_k"):
      if getattr(self, name) < 1:
        raise ValueError(f"CorrectionConfig.{name} must be >= 1, got {getattr(self, name)}")
    if not 0 <= self.mask_low < self.mask_high:
      raise ValueError(f"CorrectionConfig.mask_low={self.mask_low} must be >= 0 and below mask_high={self.mask_high}")
    if self.veto_floor <= 0:
      raise ValueError(f"CorrectionConfig.veto_floor must be > 0, got {self.veto_floor}")


@dataclasses.dataclass(frozen=True)
class Sequences:
  """Which sequence each token of a [B, T] call belongs to: flat ids over rows * (T + 1) slots, and the mask of the
  completion tokens (the tokens a sequence's ratio is made of)."""

  ids: jax.Array  # [B * T] int32
  mask: jax.Array  # [B, T] float32
  slots: int

  @classmethod
  def of(cls, mask, segment_ids=None) -> Sequences:
    rows, width = mask.shape
    segments = jnp.ones(mask.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    ids = (jnp.arange(rows, dtype=jnp.int32)[:, None] * (width + 1) + segments).reshape(-1)
    return cls(ids, mask.astype(jnp.float32), rows * (width + 1))

  def sums(self, values) -> jax.Array:
    """Per sequence slot, the sum of `values` [B, T] over its completion tokens."""
    return jax.ops.segment_sum((values * self.mask).reshape(-1), self.ids, num_segments=self.slots)

  def lengths(self) -> jax.Array:
    return self.sums(jnp.ones_like(self.mask))

  def count(self) -> jax.Array:
    """Sequences with at least one completion token."""
    return jnp.sum(self.lengths() > 0)

  def spread(self, per_sequence) -> jax.Array:
    """A per-slot value back on each token [B, T]."""
    return per_sequence[self.ids].reshape(self.mask.shape)

  def total(self, values) -> jax.Array:
    """Each token's sequence sum of `values` [B, T]."""
    return self.spread(self.sums(values))

  def mean(self, values) -> jax.Array:
    """Each token's sequence mean of `values` [B, T] over the completion tokens."""
    return self.spread(self.sums(values) / jnp.maximum(self.lengths(), 1.0))

  def minimum(self, values) -> jax.Array:
    """Each token's sequence minimum of `values` over the completion tokens (+inf for a sequence of none)."""
    masked = jnp.where(self.mask > 0, values, jnp.inf).reshape(-1)
    return self.spread(jax.ops.segment_min(masked, self.ids, num_segments=self.slots))


@dataclasses.dataclass(frozen=True)
class Correction:
  """What the corrections make of a call's tokens: the weight (1 where none applies), the tokens kept, and those
  whose weight was truncated."""

  weight: jax.Array
  keep: jax.Array
  truncated: jax.Array


def _truncated(log_weight, bands: CorrectionConfig):
  log_cap = math.log(bands.tis_cap)
  return jnp.exp(jnp.minimum(log_weight, log_cap)), log_weight > log_cap


def _inside(log_ratio, low: float, high: float):
  return (log_ratio >= (math.log(low) if low > 0 else -jnp.inf)) & (log_ratio <= math.log(high))


def _untouched(log_ratio):
  return jnp.ones_like(log_ratio), jnp.ones(log_ratio.shape, bool), jnp.zeros(log_ratio.shape, bool)


@CORRECTIONS.register("token_tis")
def token_tis(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """Truncated importance sampling per token: min(exp(r_t), tis_cap)."""
  weight, cut = _truncated(log_ratio, bands)
  return weight, jnp.ones(log_ratio.shape, bool), cut


@CORRECTIONS.register("sequence_tis")
def sequence_tis(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """Truncated sequence importance sampling: min(exp(sum_t r_t), tis_cap) on each of its tokens."""
  weight, cut = _truncated(seqs.total(log_ratio), bands)
  return weight, jnp.ones(log_ratio.shape, bool), cut


@CORRECTIONS.register("geometric_tis")
def geometric_tis(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """The geometric mean of a sequence's token ratios, truncated: min(exp(mean_t r_t), tis_cap)."""
  weight, cut = _truncated(seqs.mean(log_ratio), bands)
  return weight, jnp.ones(log_ratio.shape, bool), cut


@CORRECTIONS.register("token_mask")
def token_mask(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """Masked importance sampling per token: tokens whose ratio leaves [mask_low, mask_high] are rejected."""
  ones, _, none = _untouched(log_ratio)
  return ones, _inside(log_ratio, bands.mask_low, bands.mask_high), none


@CORRECTIONS.register("sequence_mask")
def sequence_mask(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """A sequence whose ratio product leaves [mask_low, mask_high] is rejected whole."""
  ones, _, none = _untouched(log_ratio)
  return ones, _inside(seqs.total(log_ratio), bands.mask_low, bands.mask_high), none


@CORRECTIONS.register("geometric_mask")
def geometric_mask(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """A sequence whose geometric-mean ratio leaves [mask_low, mask_high] is rejected whole."""
  ones, _, none = _untouched(log_ratio)
  return ones, _inside(seqs.mean(log_ratio), bands.mask_low, bands.mask_high), none


@CORRECTIONS.register("icepop")
def icepop(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """IcePop: tokens whose ratio leaves [1 / icepop_k, icepop_k], on either side, are rejected."""
  ones, _, none = _untouched(log_ratio)
  return ones, _inside(log_ratio, 1.0 / bands.icepop_k, bands.icepop_k), none


@CORRECTIONS.register("veto")
def veto(log_ratio, seqs: Sequences, bands: CorrectionConfig):
  """A sequence holding any token ratio below veto_floor is rejected whole (one catastrophic token)."""
  ones, _, none = _untouched(log_ratio)
  return ones, seqs.minimum(log_ratio) >= math.log(bands.veto_floor), none


def correct(log_ratio, seqs: Sequences, parts: tuple[str, ...], bands: CorrectionConfig) -> Correction:
  """The parts named, composed: weights multiplied, keep masks and truncation marks combined; the weight is 0 on
  a rejected token. `log_ratio` [B, T] is taken without gradient."""
  log_ratio = sg(log_ratio.astype(jnp.float32))
  weight, keep, truncated = _untouched(log_ratio)
  for name in parts:
    w, k, t = CORRECTIONS.get(name)(log_ratio, seqs, bands)
    weight, keep, truncated = weight * w, keep & k, truncated | t
  return Correction(jnp.where(keep, weight, 0.0), keep, truncated & keep)


def ratio_histogram(log_ratio, mask) -> jax.Array:
  """Counts [HISTOGRAM_BINS + 2] of the masked tokens' log-ratios over [-HISTOGRAM_EDGE, HISTOGRAM_EDGE] in equal
  bins, with an end bin on each side for what lies beyond: summed over calls, the step's exact histogram."""
  width = 2 * HISTOGRAM_EDGE / HISTOGRAM_BINS
  index = jnp.clip(jnp.floor((log_ratio + HISTOGRAM_EDGE) / width).astype(jnp.int32) + 1, 0, HISTOGRAM_BINS + 1)
  return jax.ops.segment_sum(mask.astype(jnp.float32).reshape(-1), index.reshape(-1), num_segments=HISTOGRAM_BINS + 2)


def histogram_quantile(histogram, q: float) -> jax.Array:
  """The ratio (not its log) at quantile `q` of a `ratio_histogram`: the centre of the bin where the cumulative count
  reaches q of the total (the end bins read as their edges); NaN for an empty histogram."""
  width = 2 * HISTOGRAM_EDGE / HISTOGRAM_BINS
  centres = -HISTOGRAM_EDGE + width * (jnp.arange(HISTOGRAM_BINS + 2) - 0.5)
  centres = jnp.clip(centres, -HISTOGRAM_EDGE, HISTOGRAM_EDGE)
  cumulative = jnp.cumsum(histogram)
  total = cumulative[-1]
  index = jnp.minimum(jnp.sum(cumulative < q * total), HISTOGRAM_BINS + 1)
  return jnp.where(total > 0, jnp.exp(centres[index]), jnp.nan)
