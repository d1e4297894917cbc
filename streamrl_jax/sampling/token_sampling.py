"""Token selection for a batch of slots, each with its own temperature, top-k, top-p and RNG key: from the tempered
logits at or above their `truncation.truncation_floor` (the trainer scores over the same support)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl_jax.truncation import truncation_floor


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array | None = None) -> jax.Array:
  """Log-probabilities [S, V] of the distribution each slot samples from: the tempered logits at or above their
  `truncation_floor`, renormalised. Temperature 0 (greedy) keeps the temperature-1 distribution, whose argmax it
  takes."""
  logits = logits.astype(jnp.float32)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  floor = truncation_floor(scaled, top_k, top_p, min_p)
  return jax.nn.log_softmax(jnp.where(scaled >= floor[:, None], scaled, -jnp.inf), axis=-1)


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


def sample_tokens(logits, keys, temperature, top_k, top_p, min_p=None):
  """(tokens [S] int32, logprobs [S] float32) for logits [S, V] and one key per slot: drawn from the filtered
  distribution (`_draw`), or its argmax at temperature 0."""
  logprobs = filter_logits(logits, temperature, top_k, top_p, min_p)
  tokens = jnp.where(temperature > 0, _draw(jnp.exp(logprobs), keys), _argmax(logprobs)).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
