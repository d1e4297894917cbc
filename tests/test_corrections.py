"""Off-policy corrections against numpy formulas and hand-worked cases; sequence-level parts on packed rows equal to
the sequences alone; the ratio histogram's quantiles against numpy's."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.training.corrections import (CORRECTIONS, HISTOGRAM_BINS, HISTOGRAM_EDGE, CorrectionConfig, Sequences, correct,
                                               histogram_quantile, ratio_histogram)

RNG = np.random.default_rng(3)
B, T = 5, 9
MASK = np.zeros((B, T), bool)
for row, (start, end) in enumerate([(2, 9), (3, 6), (1, 9), (4, 7), (2, 4)]):
  MASK[row, start:end] = True
LOG_RATIO = RNG.normal(0, 0.3, (B, T)).astype(np.float32)
LOG_RATIO[2, 5] = -12.0  # one catastrophic token: the veto's case
BANDS = CorrectionConfig(tis_cap=1.5, mask_low=0.6, mask_high=1.8, icepop_k=1.7, veto_floor=1e-3)


def np_per_row(values, reduce):
  """Each token's row value of `reduce` over the row's completion tokens."""
  return np.stack([np.full(T, reduce(values[r][MASK[r]])) for r in range(B)])


def np_part(name: str, r: np.ndarray, b: CorrectionConfig):
  """(weight, keep) of one part, written from its definition."""
  ones, everywhere = np.ones_like(r), np.ones(r.shape, bool)
  seq_sum, seq_mean = np_per_row(r, np.sum), np_per_row(r, np.mean)
  within = lambda x, lo, hi: (np.exp(x) >= lo) & (np.exp(x) <= hi)  # noqa: E731
  return {"token_tis": (np.minimum(np.exp(r), b.tis_cap), everywhere),
          "sequence_tis": (np.minimum(np.exp(seq_sum), b.tis_cap), everywhere),
          "geometric_tis": (np.minimum(np.exp(seq_mean), b.tis_cap), everywhere),
          "token_mask": (ones, within(r, b.mask_low, b.mask_high)),
          "sequence_mask": (ones, within(seq_sum, b.mask_low, b.mask_high)),
          "geometric_mask": (ones, within(seq_mean, b.mask_low, b.mask_high)),
          "icepop": (ones, within(r, 1 / b.icepop_k, b.icepop_k)),
          "veto": (ones, np_per_row(np.exp(r), np.min) >= b.veto_floor)}[name]


def test_every_registered_part_has_a_numpy_formula():
  assert set(CORRECTIONS.names()) == {"token_tis", "sequence_tis", "geometric_tis", "token_mask", "sequence_mask",
                                      "geometric_mask", "icepop", "veto"}


@pytest.mark.parametrize("name", sorted(CORRECTIONS.names()))
def test_each_part_matches_its_numpy_formula(name):
  fix = correct(jnp.asarray(LOG_RATIO), Sequences.of(jnp.asarray(MASK)), (name,), BANDS)
  weight, keep = np_part(name, LOG_RATIO.astype(np.float64), BANDS)
  np.testing.assert_array_equal(np.asarray(fix.keep)[MASK], keep[MASK])
  np.testing.assert_allclose(np.asarray(fix.weight)[MASK], np.where(keep, weight, 0.0)[MASK], rtol=1e-6, atol=1e-7)
  assert 0 < keep[MASK].sum() and (name.endswith("_tis") or not keep[MASK].all())  # each band bites somewhere


def test_parts_compose_weights_multiplied_masks_intersected():
  parts = ("geometric_tis", "token_mask", "veto")
  fix = correct(jnp.asarray(LOG_RATIO), Sequences.of(jnp.asarray(MASK)), parts, BANDS)
  pairs = [np_part(p, LOG_RATIO.astype(np.float64), BANDS) for p in parts]
  keep = np.logical_and.reduce([k for _, k in pairs])
  weight = np.prod([w for w, _ in pairs], axis=0)
  np.testing.assert_array_equal(np.asarray(fix.keep)[MASK], keep[MASK])
  np.testing.assert_allclose(np.asarray(fix.weight)[MASK], np.where(keep, weight, 0)[MASK], rtol=1e-6, atol=1e-7)
  assert not np.asarray(fix.keep)[2][MASK[2]].any()  # row 2 holds the catastrophic token: vetoed whole


def test_hand_worked_cases():
  mask = jnp.asarray([[False, True, True, True]])
  r = jnp.log(jnp.asarray([[1.0, 0.5, 3.0, 1.2]]))
  seqs, bands = Sequences.of(mask), CorrectionConfig(tis_cap=2.0, mask_low=0.5, mask_high=2.0, icepop_k=2.5, veto_floor=0.6)
  got = lambda part: correct(r, seqs, (part,), bands)  # noqa: E731
  np.testing.assert_allclose(got("token_tis").weight[0, 1:], [0.5, 2.0, 1.2], rtol=1e-6)  # 3.0 capped at 2
  np.testing.assert_array_equal(got("token_tis").truncated[0, 1:], [False, True, False])
  np.testing.assert_allclose(got("sequence_tis").weight[0, 1:], [1.8] * 3, rtol=1e-6)  # 0.5 * 3 * 1.2 = 1.8
  np.testing.assert_allclose(got("geometric_tis").weight[0, 1:], [1.8 ** (1 / 3)] * 3, rtol=1e-6)
  np.testing.assert_array_equal(got("token_mask").keep[0, 1:], [True, False, True])  # 3.0 leaves [0.5, 2]
  np.testing.assert_array_equal(got("icepop").keep[0, 1:], [True, False, True])  # 3.0 leaves [0.4, 2.5]
  np.testing.assert_array_equal(got("veto").keep[0, 1:], [False] * 3)  # 0.5 < 0.6: the whole sequence
  np.testing.assert_array_equal(got("sequence_mask").keep[0, 1:], [True] * 3)  # 1.8 inside [0.5, 2]


def test_a_long_sequence_product_does_not_overflow():
  mask = jnp.ones((1, 400), bool).at[0, 0].set(False)
  fix = correct(jnp.full((1, 400), 1.0), Sequences.of(mask), ("sequence_tis",), CorrectionConfig(tis_cap=3.0))
  np.testing.assert_allclose(np.asarray(fix.weight)[0, 1:], 3.0)  # exp(399) would be inf


@pytest.mark.parametrize("parts", [("sequence_tis", "veto"), ("geometric_mask",), ("geometric_tis", "icepop")])
def test_sequence_parts_on_packed_rows_equal_each_sequence_alone(parts):
  """Two rows packed into one (segment ids 1, 2) give each token what it gets alone: a sequence's quantities come
  from its own tokens only (and a call holds whole sequences: `packing.pack_plan` never splits one)."""
  alone = correct(jnp.asarray(LOG_RATIO), Sequences.of(jnp.asarray(MASK)), parts, BANDS)
  a, b = 0, 2
  la, lb = MASK[a].sum(), MASK[b].sum()
  packed_r = np.zeros((1, la + lb + 3), np.float32)
  packed_mask, segments = np.zeros_like(packed_r, bool), np.zeros_like(packed_r, np.int32)
  packed_r[0, 1:1 + la], packed_r[0, 2 + la:2 + la + lb] = LOG_RATIO[a][MASK[a]], LOG_RATIO[b][MASK[b]]
  packed_mask[0, 1:1 + la], packed_mask[0, 2 + la:2 + la + lb] = True, True
  segments[0, :1 + la], segments[0, 1 + la:2 + la + lb] = 1, 2
  packed = correct(jnp.asarray(packed_r), Sequences.of(jnp.asarray(packed_mask), jnp.asarray(segments)), parts, BANDS)
  got = np.asarray(packed.weight)[packed_mask]
  np.testing.assert_allclose(got, np.concatenate([np.asarray(alone.weight)[a][MASK[a]],
                                                  np.asarray(alone.weight)[b][MASK[b]]]), rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1.9, 1.9, allow_nan=False), min_size=5, max_size=60), st.sampled_from([0.05, 0.5, 0.95]))
def test_histogram_quantile_is_numpy_quantile_to_a_bin(values, q):
  r = np.asarray(values, np.float32)[None]
  histogram = ratio_histogram(jnp.asarray(r), jnp.ones(r.shape, bool))
  assert float(histogram.sum()) == r.size
  got = float(histogram_quantile(histogram, q))
  # the bin holding numpy's "inverted_cdf" quantile: the first value whose cumulative share reaches q
  expected = np.quantile(r[0], q, method="inverted_cdf")
  width = 2 * HISTOGRAM_EDGE / HISTOGRAM_BINS
  assert abs(np.log(got) - expected) <= width / 2 + 1e-5


def test_histogram_end_bins_hold_what_lies_beyond():
  r = jnp.asarray([[-5.0, 0.0, 9.0]])
  histogram = np.asarray(ratio_histogram(r, jnp.ones(r.shape, bool)))
  assert histogram[0] == 1 and histogram[-1] == 1 and histogram.sum() == 3
  assert float(histogram_quantile(jnp.asarray(histogram), 0.99)) == pytest.approx(np.exp(HISTOGRAM_EDGE))
  assert np.isnan(float(histogram_quantile(jnp.zeros(HISTOGRAM_BINS + 2), 0.5)))


def test_a_ratio_of_one_reads_as_one():
  histogram = ratio_histogram(jnp.zeros((2, 5)), jnp.ones((2, 5), bool))
  assert float(histogram_quantile(histogram, 0.5)) == 1.0


def test_a_runs_truncated_sampling_reaches_the_samplers_and_the_trainers_scores():
  """SamplerConfig.top_p reaches both sides of a run: in an on-policy run at equal precision the trainer's
  log-probabilities (over the support it rebuilt) are the sampler's truncated ones (were either side not told, every
  ratio would be off by the cut mass), no drawn token lies outside that support, and the trainer's entropy is the
  truncated distribution's, below the full one's."""
  import dataclasses

  from tests.pipeline_setup import BASE, run
  rows = {p: run("stream", sampler=dataclasses.replace(BASE.sampler, top_p=p, precision="float32"),
                 steps=1).metrics[0] for p in (0.7, 1.0)}
  assert rows[0.7]["support_mismatch_frac"] == 0 and rows[0.7]["logprob_mismatch_max"] < 1e-3, rows[0.7]
  assert rows[0.7]["entropy"] < rows[1.0]["entropy"] - 0.2, rows  # near-uniform over 86: about log 60 against log 86
