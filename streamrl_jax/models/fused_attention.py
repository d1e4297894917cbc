"""Attention as fused kernels on a TPU, from jax's Pallas TPU ops:

- the trainer's, splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) over rows of packed samples,
  causal, each token seeing its own segment alone, a sliding layer its window. XLA's attention builds every layer's
  [heads, T, T] scores in float32 (3.4 GB a row of 5,120 tokens for 32 heads); the kernel walks them in tiles and keeps
  none. `TrainerConfig.attention`: 'auto' (the kernel on a TPU, XLA's elsewhere), 'xla', or 'splash';
- a decode step's over the paged KV cache, paged attention (`...ops.tpu.paged_attention`): each row's query against
  the pages its table names, up to its length, without gathering them into a contiguous copy. Layers with a sliding
  window keep the gather (the kernel masks by length alone). `EngineConfig.attention`: 'auto', 'xla', or 'paged'.

A kernel named on a backend other than a TPU runs in Pallas' interpret mode: slow, and how the tests hold it to XLA's
numbers on a CPU. Each kernel runs per device under `shard_map`: rows split over the mesh's batch axes (the trainer's),
heads over "tensor" where it divides them.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from streamrl_jax.models.compile_target import target_backend
from streamrl_jax.models.sharding import batch_axes

ATTENTION = ("auto", "xla", "splash")  # TrainerConfig.attention
DECODE_ATTENTION = ("auto", "xla", "paged")  # EngineConfig.attention
TILE = 128  # rows are padded to a multiple of this many tokens for the kernel


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
  """Where the fused attention runs: the mesh its calls are sharded over, and whether in Pallas' interpret mode."""

  mesh: Mesh
  interpret: bool = False

  def takes_head_dim(self, head_dim: int) -> bool:
    """Whether the decode kernel runs heads of this size: a TPU's tiles are 128 lanes wide (interpret mode takes any);
    other sizes keep the gather."""
    return self.interpret or head_dim % 128 == 0


def trainer_kernel(choice: str, mesh: Mesh) -> AttentionKernel | None:
  """The kernel `TrainerConfig.attention = choice` asks for on the backend being compiled for; None: XLA's."""
  return _kernel(choice, mesh, ATTENTION, "TrainerConfig.attention")


def decode_kernel(choice: str, mesh: Mesh) -> AttentionKernel | None:
  """The kernel `EngineConfig.attention = choice` asks for on the backend being compiled for; None: XLA's."""
  return _kernel(choice, mesh, DECODE_ATTENTION, "EngineConfig.attention")


def _kernel(choice: str, mesh: Mesh, known: tuple[str, ...], key: str) -> AttentionKernel | None:
  if choice not in known:
    raise ValueError(f"{key}={choice!r}; known: {list(known)}")
  on_tpu = target_backend() == "tpu"
  if choice == "xla" or (choice == "auto" and not on_tpu):
    return None
  return AttentionKernel(mesh, interpret=not on_tpu)


@flax.struct.dataclass
class SegmentMask:
  """What a layer's attention sees when the kernel computes it: each token's segment [B, T] (samples of a packed row
  1, 2, ...; 0 padding), causal within it, and the layer's sliding window (None: every earlier token)."""

  segment_ids: jax.Array
  window: int | None = flax.struct.field(pytree_node=False, default=None)
  kernel: AttentionKernel | None = flax.struct.field(pytree_node=False, default=None)

  def with_window(self, window: int | None) -> SegmentMask:
    return self.replace(window=window)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention of q [B, T, Hq, D] over k, v [B, T, Hkv, D] (token-major, as the projections give them), scaled by
    head_dim ** -0.5; [B, T, Hq, D] in q's dtype."""
    return segment_attention(q, k, v, self.segment_ids, self.window, self.kernel)


def segment_attention(q, k, v, segment_ids, window: int | None, kernel: AttentionKernel) -> jax.Array:
  """`SegmentMask.attend`: the rows padded to a multiple of `TILE` (the padding its own segment, -1), the kernel run on
  each device's rows and heads (`shard_map`), the padding cut off again."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  width = -(-t // TILE) * TILE
  if width != t:
    pad = lambda x, fill=0: jnp.pad(x, ((0, 0), (0, width - t)) + ((0, 0),) * (x.ndim - 2),  # noqa: E731
                                    constant_values=fill)
    q, k, v, segment_ids = pad(q), pad(k), pad(v), pad(segment_ids, -1)
  mesh = kernel.mesh
  batch = batch_axes(mesh, b)
  tensor = mesh.shape.get("tensor", 1)
  heads = "tensor" if tensor > 1 and hkv % tensor == 0 else None
  rows = PartitionSpec(batch or None, None, heads, None)
  # made out here: under shard_map its mask arrays would take that mesh, and the cache would hand them to another
  call = _splash(width, hq // (tensor if heads else 1), window, kernel.interpret)
  local = functools.partial(_local_attention, call=call)
  out = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, PartitionSpec(batch or None, None)),
                      out_specs=rows, check_vma=False)(q, k, v, segment_ids.astype(jnp.int32))
  return out[:, :t]


def _local_attention(q, k, v, segment_ids, *, call):
  """One device's rows: the splash kernel `call` on each row, heads-major ([Hq, T, D] queries over [Hkv, T, D])."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  d = q.shape[3]
  scale = jnp.asarray(d ** -0.5, q.dtype)

  def row(q, k, v, ids):
    out = call((q * scale).transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2),
               segment_ids=splash.SegmentIds(ids, ids))
    return out.transpose(1, 0, 2)
  return jax.vmap(row)(q, k, v, segment_ids).astype(q.dtype)


@functools.cache
def _splash(length: int, heads: int, window: int | None, interpret: bool):
  """The splash kernel of rows of `length` tokens and `heads` query heads: causal, or a causal window of `window`
  positions (a query sees the `window` tokens up to itself), in tiles of up to 512 tokens that divide the row."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  shape = (length, length)
  one = masks.CausalMask(shape) if window is None else masks.LocalMask(shape, (window - 1, 0), 0)
  tile = next(size for size in (512, 256, TILE) if length % size == 0)
  blocks = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
                             block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
  return splash.make_splash_mha(masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1,
                                block_sizes=blocks, interpret=interpret)


def paged_decode_attention(q, k_pages, v_pages, table, lengths, kernel: AttentionKernel) -> jax.Array:
  """One decode step's attention over the paged cache: q [B, 1, Hq, D] (each row's new token, its key and value
  already written) against k_pages, v_pages [Hkv, pages, page size, D] at each row's pages (`table` [B, M]) up to its
  `lengths` [B] tokens, scaled by head_dim ** -0.5; [B, 1, Hq, D]. The kernel reads keys and values in bfloat16."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  b, _, hq, d = q.shape
  hkv, _, page_size, _ = k_pages.shape
  pages = table.shape[1]
  block = max(n for n in range(1, pages + 1) if pages % n == 0 and n * page_size <= max(page_size, 512))
  tensor = kernel.mesh.shape.get("tensor", 1)
  heads = "tensor" if tensor > 1 and hkv % tensor == 0 else None

  def local(q, k_pages, v_pages, lengths, table):
    call = functools.partial(paged_attention, pages_per_compute_block=block)
    if kernel.interpret:
      import jax.experimental.pallas.tpu as pltpu

      with pltpu.force_tpu_interpret_mode():
        return call(q, k_pages, v_pages, lengths, table)
    return call(q, k_pages, v_pages, lengths, table)

  scaled = (q[:, 0] * jnp.asarray(d ** -0.5, q.dtype)).astype(k_pages.dtype)
  rows, pool = PartitionSpec(None, heads, None), PartitionSpec(heads, None, None, None)
  out = jax.shard_map(local, mesh=kernel.mesh, in_specs=(rows, pool, pool, PartitionSpec(), PartitionSpec()),
                      out_specs=rows, check_vma=False)(scaled, k_pages, v_pages,
                                                       jnp.maximum(lengths, 1).astype(jnp.int32),
                                                       jnp.maximum(table, 0).astype(jnp.int32))
  return out[:, None].astype(q.dtype)
