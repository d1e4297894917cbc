"""Batch generation through the KV cache: one jitted prefill plus a scan of decode steps.

This is the simple static-batch path used by demos and parity tests; the continuous-batching
engine that streams finished samples lives in `streamrl_jax.sampling`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.models.kv_cache import KVCache
from streamrl_jax.models.transformer import Transformer


def pad_prompts(prompts: list[list[int]], pad_id: int, *, side: str = "left", length: int | None = None):
  """Pads token lists to one length; returns (tokens [B, L] int32, mask [B, L] bool)."""
  if side not in ("left", "right"):
    raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  length = length or max(len(p) for p in prompts)
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for row, prompt in enumerate(prompts):
    if len(prompt) > length:
      raise ValueError(f"prompt {row} has {len(prompt)} tokens, more than the padded length {length}")
    cols = slice(length - len(prompt), length) if side == "left" else slice(0, len(prompt))
    tokens[row, cols], mask[row, cols] = prompt, True
  return tokens, mask


def last_valid_index(mask: jax.Array) -> jax.Array:
  """Index of each row's last real token, for left or right padding."""
  return mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)


def generate(model: Transformer, tokens, mask, max_new_tokens: int, *, temperature: float = 0.0,
             seed: int = 0) -> np.ndarray:
  """New tokens [B, max_new_tokens] after the padded prompts; greedy when temperature is 0."""
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  graphdef, state = nnx.split(model)
  out = _generate(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(seed),
                  max_new_tokens, float(temperature))
  return np.asarray(out)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _generate(graphdef, state, tokens, mask, key, max_new_tokens, temperature):
  model = nnx.merge(graphdef, state)
  cache = KVCache.init(model.config, tokens.shape[0], tokens.shape[1] + max_new_tokens)
  logits, cache = model.forward_with_cache(tokens, cache, mask, logits_at=last_valid_index(mask))
  last = logits[:, 0]

  def pick(logits, step):
    if temperature == 0.0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(jax.random.fold_in(key, step), logits / temperature).astype(jnp.int32)

  def step(carry, i):
    token, cache = carry
    logits, cache = model.forward_with_cache(token[:, None], cache)
    return (pick(logits[:, 0], i + 1), cache), token

  _, out = jax.lax.scan(step, (pick(last, 0), cache), jnp.arange(max_new_tokens))
  return out.T
