"""Token selection (`sampling.token_sampling`): top-k and top-p against a sorted numpy reference, sampled frequencies
against the filtered distribution (across vocabulary blocks, never a zero-probability entry), the blockwise argmax
against `jnp.argmax`."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamrl_jax.sampling import filter_logits


def test_filter_logits_top_k_top_p_by_hand():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 3))
  out = np.exp(np.asarray(filter_logits(logits, jnp.asarray([1.0, 1.0, 1.0]), jnp.asarray([2, 0, 0]),
                                        jnp.asarray([1.0, 0.8, 0.81]))))
  np.testing.assert_allclose(out[0], [0.625, 0.375, 0, 0], atol=1e-6)  # top-2
  np.testing.assert_allclose(out[1], [0.625, 0.375, 0, 0], atol=1e-6)  # 0.5 + 0.3 reaches 0.8
  np.testing.assert_allclose(out[2], np.array([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)
  hot = np.exp(np.asarray(filter_logits(logits[:1], jnp.asarray([2.0]), jnp.asarray([0]), jnp.asarray([1.0]))))
  p = np.sqrt([0.5, 0.3, 0.15, 0.05])
  np.testing.assert_allclose(hot[0], p / p.sum(), atol=1e-6)


def test_min_p_keeps_tokens_at_least_that_share_of_the_most_likely_by_hand():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 3))
  out = np.exp(np.asarray(filter_logits(logits, jnp.ones(3), jnp.asarray([0, 0, 3]), jnp.ones(3),
                                        jnp.asarray([0.3, 0.61, 0.2]))))
  np.testing.assert_allclose(out[0], np.array([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)  # 0.15 >= 0.3 * 0.5
  np.testing.assert_allclose(out[1], [1, 0, 0, 0], atol=1e-6)  # 0.3 < 0.61 * 0.5
  np.testing.assert_allclose(out[2], np.array([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)  # top-3 and min-p: both


def numpy_kept(logits, temperature, k, p):
  """Reference top-k/top-p by sorting: the set of kept token ids."""
  scaled = logits / (temperature if temperature > 0 else 1.0)
  order = np.argsort(-scaled, kind="stable")
  probs = np.exp(scaled[order] - scaled.max())
  probs /= probs.sum()
  mass_before = np.cumsum(probs) - probs
  p = np.float32(p)  # as the sampler holds it
  keep = (np.arange(len(order)) < (k or len(order))) & ((mass_before < p) | (p >= 1.0))  # top_p 1: off
  return set(order[keep].tolist())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 12), st.floats(0.05, 1.0), st.floats(0.3, 2.0))
@example(2, 0, 1.0, 0.5)  # float32 mass before the last token rounds to 1.0: top_p 1 must still keep it
@example(3375, 9, 1.0, 0.5625)  # ... also beside top-k (the top 8 tokens' float32 mass is 1.0)
@example(2, 0, 0.9999999999999999, 0.5)  # 1.0 in float32
def test_filter_logits_keeps_the_sorted_reference_set(seed, k, p, temperature):
  logits = np.random.default_rng(seed).normal(0, 3, (2, 12)).astype(np.float32)
  out = np.asarray(filter_logits(jnp.asarray(logits), jnp.full((2,), temperature, jnp.float32),
                                 jnp.full((2,), k, jnp.int32), jnp.full((2,), p, jnp.float32)))
  for row in range(2):
    assert set(np.flatnonzero(np.isfinite(out[row])).tolist()) == numpy_kept(logits[row], temperature, k, p)
    np.testing.assert_allclose(np.exp(out[row]).sum(), 1.0, rtol=1e-5)


def test_sampled_frequencies_follow_the_filtered_distribution():
  from streamrl_jax.sampling import sample_tokens
  n = 20000
  logits = jnp.tile(jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1, 0.0])), (n, 1))
  keys = jax.random.split(jax.random.key(0), n)
  tokens, logprobs = sample_tokens(logits, keys, jnp.ones((n,)), jnp.full((n,), 3, jnp.int32), jnp.ones((n,)))
  freq = np.bincount(np.asarray(tokens), minlength=5) / n
  np.testing.assert_allclose(freq, [4 / 9, 3 / 9, 2 / 9, 0, 0], atol=0.015)
  np.testing.assert_allclose(np.exp(np.asarray(logprobs)), np.array([4, 3, 2, 0, 0])[np.asarray(tokens)] / 9,
                             rtol=1e-5)


def test_two_stage_draw_across_blocks_follows_the_distribution_and_skips_zeros():
  from streamrl_jax.sampling.token_sampling import BLOCK, sample_tokens
  vocab, n = 2 * BLOCK + 88, 30000  # three blocks, the last one padded
  mass = {3: 0.1, BLOCK - 1: 0.2, BLOCK: 0.3, vocab - 1: 0.4}  # block edges, the last entry; every other entry 0
  row = np.full(vocab, -np.inf, np.float32)
  row[list(mass)] = np.log(list(mass.values()))
  tokens, logprobs = jax.jit(sample_tokens)(jnp.tile(jnp.asarray(row), (n, 1)), jax.random.split(jax.random.key(1), n),
                                            jnp.ones((n,)), jnp.zeros((n,), jnp.int32), jnp.ones((n,)))
  tokens = np.asarray(tokens)
  assert set(tokens.tolist()) <= set(mass)  # a zero-probability entry is never drawn
  freq = np.bincount(tokens, minlength=vocab)[list(mass)] / n
  np.testing.assert_allclose(freq, list(mass.values()), atol=0.012)
  np.testing.assert_allclose(np.exp(np.asarray(logprobs)), np.asarray([mass[t] for t in tokens]), rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.integers(0, 2**31 - 1), st.booleans())
def test_blockwise_argmax_is_jnp_argmax(vocab, seed, ties):
  from streamrl_jax.sampling.token_sampling import _argmax
  rng = np.random.default_rng(seed)
  logits = rng.integers(0, 3, (3, vocab)).astype(np.float32) if ties else rng.normal(size=(3, vocab)).astype(np.float32)
  logits[0, rng.integers(vocab)] = -np.inf
  np.testing.assert_array_equal(np.asarray(_argmax(jnp.asarray(logits))), np.argmax(logits, axis=-1))
