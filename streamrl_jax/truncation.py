"""The support a truncated sampling distribution keeps (top-k, top-p), as a floor on the tempered logits: the one
function the sampler draws with and the trainer rebuilds the support with, so that at equal weights both score a
token over the same renormalised distribution.

No sort over the vocabulary (slow on CPU): the top-k and top-p cut-offs are found by bisection on the float32 bit
patterns of the logits, which after 32 rounds lands exactly on a logit value.
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


def truncation_floor(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     min_p: jax.Array | None = None) -> jax.Array:
  """Per row of tempered logits [S, V], the smallest logit the top-k, top-p and min-p filters keep (-inf where none
  is on): top-k keeps the k largest logits (0 = all); top-p keeps the smallest set of largest logits whose mass
  reaches p (the top token always stays); min-p keeps the tokens at least min_p times as likely as the most likely
  (0 = all). Ties at a cut-off are kept. The sampler draws from, and the trainer scores over, the entries at or
  above it."""
  scaled = scaled.astype(jnp.float32)
  min_p = jnp.zeros(top_p.shape, jnp.float32) if min_p is None else min_p

  def floor(scaled):
    keys = _sortable_bits(scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    k = jnp.where(top_k > 0, top_k, scaled.shape[-1])
    enough_tokens = lambda keep: jnp.sum(keep, axis=-1) >= k  # noqa: E731
    enough_mass = lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), axis=-1) >= top_p  # noqa: E731
    # top_p 1 is off: in float32 the mass of the largest tokens can round to 1 before the tail is in
    mass_cut = jnp.where(top_p >= 1.0, jnp.min(keys, axis=-1), _largest_threshold(keys, enough_mass))
    cut = jnp.maximum(_largest_threshold(keys, enough_tokens), mass_cut)
    lowest = jnp.min(jnp.where(keys >= cut[:, None], scaled, jnp.inf), axis=-1)
    # min-p: p_j >= min_p * p_max is l_j >= l_max + log(min_p); the kept entry it lands on, the lowest at or above
    relative = jnp.max(scaled, axis=-1) + jnp.log(jnp.where(min_p > 0, min_p, 1.0))
    lowest_relative = jnp.min(jnp.where(scaled >= relative[:, None], scaled, jnp.inf), axis=-1)
    lowest = jnp.where(min_p > 0, jnp.maximum(lowest, lowest_relative), lowest)
    return jnp.where((top_k > 0) | (top_p < 1.0) | (min_p > 0), lowest, -jnp.inf)

  needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0))
  return jax.lax.cond(needs_truncation, floor, lambda s: jnp.full(s.shape[:-1], -jnp.inf), scaled)
