"""Token selection for a batch of slots, each with its own temperature, top-k, top-p and RNG key.

No sort over the vocabulary (slow on CPU): the top-k and top-p cut-offs are found by bisection on
the float32 bit patterns of the logits, which after 32 rounds lands exactly on a logit value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sortable_bits(x: jax.Array) -> jax.Array:
  """uint32 keys that order like the float32 values (IEEE sign-magnitude made monotone)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, holds) -> jax.Array:
  """Per row, the largest key t for which `holds(keys >= t)` is true; `holds` must be monotone
  and true for the whole row."""

  def body(_, bounds):
    lo, hi = bounds  # holds(lo); the answer lies in [lo, hi]
    gap = hi - lo
    mid = lo + gap // 2 + gap % 2  # ceil of the midpoint, without overflow
    ok = holds(keys >= mid[:, None])
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, body, (jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)))
  return lo


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Log-probabilities [S, V] of the distribution each slot samples from.

  Temperature 0 (greedy) keeps the temperature-1 distribution, whose argmax it takes. Top-k keeps the
  k largest logits (0 = all); top-p keeps the smallest set of largest logits whose mass reaches p
  (the top token always stays). Ties at a cut-off are kept.
  """
  logits = logits.astype(jnp.float32)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

  def truncate(scaled):
    keys = _sortable_bits(scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    k = jnp.where(top_k > 0, top_k, scaled.shape[-1])
    enough_tokens = lambda keep: jnp.sum(keep, axis=-1) >= k  # noqa: E731
    enough_mass = lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), axis=-1) >= top_p  # noqa: E731
    # top_p 1 is off: in float32 the mass of the largest tokens can round to 1 before the tail is in
    mass_cut = jnp.where(top_p >= 1.0, jnp.min(keys, axis=-1), _largest_threshold(keys, enough_mass))
    cut = jnp.maximum(_largest_threshold(keys, enough_tokens), mass_cut)
    return jnp.where(keys >= cut[:, None], scaled, -jnp.inf)

  needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
  scaled = jax.lax.cond(needs_truncation, truncate, lambda s: s, scaled)
  return jax.nn.log_softmax(scaled, axis=-1)


BLOCK = 256  # vocabulary entries per block of the two-stage draw


def _first_reaching(cumulative: jax.Array, u: jax.Array) -> jax.Array:
  """Per row, the first index whose cumulative mass reaches u (a fraction of the row's total, in (0, 1))."""
  normalized = cumulative / cumulative[:, -1:]
  return jnp.minimum(jnp.sum(normalized < u[:, None], axis=-1), cumulative.shape[-1] - 1)


def _blocks(x: jax.Array, fill) -> jax.Array:
  """x [S, V] as [S, V / BLOCK, BLOCK], the last block padded with `fill`."""
  rows, vocab = x.shape
  blocks = -(-vocab // BLOCK)
  return jnp.pad(x, ((0, 0), (0, blocks * BLOCK - vocab)), constant_values=fill).reshape(rows, blocks, BLOCK)


def _in_block(blocked: jax.Array, block: jax.Array) -> jax.Array:
  return jnp.take_along_axis(blocked, block[:, None, None], axis=1)[:, 0]


def _draw(probs: jax.Array, keys) -> jax.Array:
  """One token per row of probs [S, V] in two inverse-CDF stages: a block of `BLOCK` entries by its mass, then an
  entry within it, each with its own uniform number: the product of the two is each entry's probability, and only
  [S, V / BLOCK] and [S, BLOCK] prefix sums are taken (a prefix sum over the whole vocabulary is slow on a CPU).
  A zero-probability entry is never drawn: u > 0 picks the first entry whose share of the mass reaches it."""
  blocked = _blocks(probs, 0.0)
  tiny = jnp.finfo(jnp.float32).tiny
  u = jax.vmap(lambda key: jax.random.uniform(key, (2,), jnp.float32, minval=tiny))(keys)
  block = _first_reaching(jnp.cumsum(blocked.sum(axis=-1), axis=-1), u[:, 0])
  return block * BLOCK + _first_reaching(jnp.cumsum(_in_block(blocked, block), axis=-1), u[:, 1])


def _argmax(logprobs: jax.Array) -> jax.Array:
  """The first largest entry of each row, as `jnp.argmax`, through the block of the first largest block maximum (a
  whole-vocabulary argmax is slow on a CPU)."""
  blocked = _blocks(logprobs, -jnp.inf)
  block = jnp.argmax(blocked.max(axis=-1), axis=-1)
  return block * BLOCK + jnp.argmax(_in_block(blocked, block), axis=-1)


def sample_tokens(logits, keys, temperature, top_k, top_p):
  """(tokens [S] int32, logprobs [S] float32) for logits [S, V] and one key per slot: drawn from the filtered
  distribution (`_draw`), or its argmax at temperature 0."""
  logprobs = filter_logits(logits, temperature, top_k, top_p)
  tokens = jnp.where(temperature > 0, _draw(jnp.exp(logprobs), keys), _argmax(logprobs)).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
