"""An explicit KV-cache pytree for incremental decoding, one row per batch slot.

Each row writes at its own index, so slots filled at different times (continuous batching) share one
cache. Padding written into the cache is marked invalid and never attended to; rotary positions are
tracked apart from cache indices, so left and right padding both give the positions of the unpadded text.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.layers import attend_in, cache_dtype


@flax.struct.dataclass
class KVCache:
  keys: tuple[jax.Array, ...]  # per layer [batch, kv_heads, max_len, head_dim]
  values: tuple[jax.Array, ...]
  valid: jax.Array  # [batch, max_len] bool: entry holds a real token
  positions: jax.Array  # [batch, max_len] int32: the rotary position of each entry's token (sliding windows read it)
  index: jax.Array  # [batch] int32: where the row's next token is written
  next_position: jax.Array  # [batch] int32: rotary position of the row's next real token

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = dtype or cache_dtype(config.compute_dtype)
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(keys=zeros, values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
               valid=jnp.zeros((batch, max_len), bool), positions=jnp.zeros((batch, max_len), jnp.int32),
               index=jnp.zeros((batch,), jnp.int32),
               next_position=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.valid.shape[1]

  def chunk_layout(self, token_mask: jax.Array):
    """Where a chunk of tokens [B, T] with `token_mask` goes: positions, write indices, attention mask
    [B, T, max_len] and the cache's new bookkeeping (valid, positions, index, next_position)."""
    t = token_mask.shape[1]
    positions = self.next_position[:, None] + jnp.cumsum(token_mask, axis=1, dtype=jnp.int32) - 1
    positions = jnp.maximum(positions, 0)
    write_index = self.index[:, None] + jnp.arange(t, dtype=jnp.int32)
    rows = jnp.arange(token_mask.shape[0])[:, None]
    valid = self.valid.at[rows, write_index].set(token_mask.astype(bool))
    key_positions = self.positions.at[rows, write_index].set(positions)
    slots = jnp.arange(self.max_len, dtype=jnp.int32)
    mask = valid[:, None, :] & (slots[None, None, :] <= write_index[:, :, None])
    bookkeeping = dict(valid=valid, positions=key_positions, index=self.index + t,
                       next_position=self.next_position + token_mask.sum(axis=1, dtype=jnp.int32))
    return positions, write_index, mask, bookkeeping


@flax.struct.dataclass
class ContiguousLayer:
  """One layer of a `KVCache` during a chunk: writes the chunk at `write_index` [B, T] and attends over the
  first `mask.shape[-1]` entries (a short window reads less of the cache)."""

  keys: jax.Array  # [B, kv_heads, max_len, head_dim]
  values: jax.Array
  write_index: jax.Array  # [B, T]

  def attend(self, q, k, v, mask):
    rows = jnp.arange(q.shape[0])[:, None]
    keys = self.keys.at[rows, :, self.write_index].set(k.astype(self.keys.dtype))
    values = self.values.at[rows, :, self.write_index].set(v.astype(self.values.dtype))
    window = mask.shape[-1]
    out = attend_in(keys.dtype, q, keys[:, :, :window], values[:, :, :window], mask)
    return self.replace(keys=keys, values=values), out


def kv_cache_bytes(config: ModelConfig, batch: int, max_len: int, dtype=None) -> int:
  """Bytes of keys and values for `batch` rows of `max_len` tokens (bookkeeping excluded)."""
  itemsize = jnp.dtype(dtype or cache_dtype(config.compute_dtype)).itemsize
  return 2 * config.num_layers * batch * max_len * config.num_kv_heads * config.head_dim * itemsize
