"""Token selection for a batch of slots, each with its own temperature, top-k, top-p and RNG key."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Log-probabilities [S, V] of the distribution each slot samples from.

  Temperature 0 (greedy) keeps the temperature-1 distribution, whose argmax it takes. Top-k keeps the
  k largest logits (0 = all); top-p keeps the smallest prefix of the sorted distribution whose mass
  reaches p (the top token always stays). Ties at the cut-off are kept.
  """
  logits = logits.astype(jnp.float32)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

  def truncate(scaled):
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (jnp.arange(vocab)[None, :] < k[:, None]) & (mass_before < top_p[:, None])
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)

  needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
  scaled = jax.lax.cond(needs_truncation, truncate, lambda s: s, scaled)
  return jax.nn.log_softmax(scaled, axis=-1)


def sample_tokens(logits, keys, temperature, top_k, top_p):
  """(tokens [S] int32, logprobs [S] float32) for logits [S, V] and one key per slot."""
  logprobs = filter_logits(logits, temperature, top_k, top_p)
  drawn = jax.vmap(jax.random.categorical)(keys, logprobs)
  tokens = jnp.where(temperature > 0, drawn, jnp.argmax(logprobs, axis=-1)).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
