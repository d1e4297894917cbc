"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, gated MLPs.

Every parameter carries `logical_axes` metadata; `models.sharding` maps those names onto a mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.models.compile_target import target_backend
from streamrl_jax.models.config import ModelConfig, RopeScaling
from streamrl_jax.models.fused_attention import SegmentMask


def _param(rngs: nnx.Rngs, config: ModelConfig, shape, axes, *, scale: float | None = None) -> nnx.Param:
  std = config.initializer_range if scale is None else scale
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(config.weight_dtype), logical_axes=axes)


def _constant(config: ModelConfig, shape, axes, fill: float) -> nnx.Param:
  return nnx.Param(jnp.full(shape, fill, config.weight_dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32 and scaled by `norm_offset + weight` (Gemma's weights are offsets from
  1). As Hugging Face does: Llama's family scales in the input dtype, Gemma's in float32 before casting back."""

  def __init__(self, config: ModelConfig, size: int | None = None):
    self.eps, self.offset = config.rms_norm_eps, config.norm_offset
    self.scale = _constant(config, (size or config.hidden_size,), ("norm",), 1.0 - config.norm_offset)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...]
    if self.offset:
      scale, out_dtype, normed_dtype = scale.astype(jnp.float32) + self.offset, x.dtype, jnp.float32
    else:
      out_dtype = normed_dtype = x.dtype
    if target_backend() == "cpu":  # elsewhere the sum stays a reduction: a TPU's float32 product with ones
      return scaled(scale, normed.astype(normed_dtype)).astype(out_dtype)  # would run in bfloat16 passes by default
    return (scale.astype(normed_dtype) * normed.astype(normed_dtype)).astype(out_dtype)


@jax.custom_vjp
def scaled(scale: jax.Array, normed: jax.Array) -> jax.Array:
  """scale [H] (cast to normed's dtype) * normed [..., H]. Its gradient with respect to `scale`, a sum over every
  token, is a float32 product with a vector of ones: XLA:CPU computes that sum as a windowed reduction, 1.5-2 ms a
  norm in SmolLM2's trainer calls (61 norms a call; 4% of a call's operation time)."""
  return scale.astype(normed.dtype) * normed


def _scaled_fwd(scale, normed):
  return scaled(scale, normed), (scale, normed)


def _scaled_bwd(residuals, g):
  scale, normed = residuals
  products = (g.astype(jnp.float32) * normed.astype(jnp.float32)).reshape(-1, normed.shape[-1])
  ones = jnp.ones((products.shape[0],), jnp.float32)
  d_scale = jax.lax.dot_general(ones, products, (((0,), (0,)), ((), ())))
  return d_scale.astype(scale.dtype), (g * scale.astype(g.dtype)).astype(normed.dtype)


scaled.defvjp(_scaled_fwd, _scaled_bwd)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Per-pair inverse frequencies, scaled as configured: Llama 3's frequency-dependent scaling, or linear (every
  frequency divided by the factor)."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv.astype(np.float32)
  if scaling.rope_type == "linear":
    return (inv / scaling.factor).astype(np.float32)
  wavelen = 2 * math.pi / inv
  low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
  scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] by its positions [batch, length] (rotate-half layout)."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  return _rotated(x, jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype))


def _half_turn(x):
  """The rotate-half partner of each entry: (-x2, x1) of the halves (x1, x2) of the last axis."""
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


@jax.custom_vjp
def _rotated(x, cos, sin):
  return x * cos + _half_turn(x) * sin


def _rotated_fwd(x, cos, sin):
  return _rotated(x, cos, sin), (cos, sin)


def _rotated_bwd(residuals, g):
  """The rotation's transpose, written as the rotation: g cos - half_turn(g sin). Differentiated automatically,
  the concatenation's transpose became slices, pads and sums that XLA:CPU fused with the attention layout's
  transpose into a scalar loop: 2.5 ms a layer for SmolLM2's queries (8 x 72 tokens), against 0.2 forward."""
  cos, sin = residuals
  return g * cos - _half_turn(g * sin), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rotated.defvjp(_rotated_fwd, _rotated_bwd)


def tokens_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., in] @ w [in, out] in x's dtype (w cast to it), every leading axis folded into one: a plain 2-D product
  whose gradient with respect to `w` contracts one axis. With the batch and time axes kept apart, XLA:CPU transposes
  the activations for the weight gradient (a strided copy per matmul) and the backward pass runs at half the matmul
  rate. In bfloat16 on a CPU the product goes through `cpu_low_precision_matmul`."""
  flat = x.reshape(-1, x.shape[-1])
  if cpu_low_precision(x.dtype):
    out = cpu_low_precision_matmul(flat, w)
  else:
    out = flat @ w.astype(x.dtype)
  return out.reshape(*x.shape[:-1], w.shape[-1])


def cpu_low_precision(dtype) -> bool:
  """Whether products in `dtype` take XLA:CPU's low-precision path (`cpu_low_precision_matmul`, `rows_first`)."""
  return dtype != jnp.float32 and target_backend() == "cpu"


def cache_dtype(compute_dtype):
  """The dtype a KV cache holds: the compute dtype, or float32 on a CPU computing in low precision (XLA:CPU converts
  bfloat16 elementwise work to float32 and back: a bfloat16 cache was converted whole at every decode step, 40% of
  a SmolLM2 decode step)."""
  return jnp.float32 if cpu_low_precision(compute_dtype) else jnp.dtype(compute_dtype)


def attend_in(cache_dtype_, q, k, v, mask):
  """`grouped_attention` in the cache's dtype (`cache_dtype`: q cast to it, not the cache to q's), its output in
  q's dtype."""
  return grouped_attention(q.astype(cache_dtype_), k.astype(cache_dtype_), v.astype(cache_dtype_), mask).astype(q.dtype)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """table[ids] along axis 0. A 16-bit float table on a CPU is first tied to the ids by an optimization barrier: in
  a decode loop XLA:CPU otherwise hoists the table's conversion out of the loop (bfloat16 to float32, or to its bits)
  and copies the whole table every call (a SmolLM2 embedding: 57 MB, 4 ms of an 80-90 ms decode step); tied to the
  ids, the gather reads only the rows it takes."""
  if jnp.dtype(table.dtype).itemsize == 2 and jnp.issubdtype(table.dtype, jnp.floating) and (
      target_backend() == "cpu"):
    table, ids = jax.lax.optimization_barrier((table, ids))
  return jnp.take(table, ids, axis=0)


def rows_first(a: jax.Array) -> jax.Array:
  """a [m, k] transposed to [k, m] as a row-major copy: through a blocked reshape, so that XLA:CPU cannot make the
  transpose a change of layout that its fast low-precision matmul does not take (it would compute in float32)."""
  m, k = a.shape
  block = next((b for b in (64, 32, 16, 8) if k % b == 0), 0)
  if not block:
    return a.T
  return a.reshape(m, k // block, block).transpose(1, 2, 0).reshape(k, m)


@jax.custom_vjp
def cpu_low_precision_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [m, in] (bfloat16) @ w [in, out] (any float dtype, cast to x's) as XLA:CPU multiplies low precision fast: with
  float32 results (a bfloat16 result makes it compute in float32, several times slower where the CPU has bfloat16
  matrix units) and, in the backward pass, row-major operands (`rows_first`). The weight's gradient is the float32
  product cast to w's dtype, never rounded through x's."""
  return _f32_dot(x, w.astype(x.dtype), 1, 0).astype(x.dtype)


def _f32_dot(a, b, a_axis: int, b_axis: int):
  return jax.lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((), ())), preferred_element_type=jnp.float32)


def _cpu_matmul_fwd(x, w):
  low = w.astype(x.dtype)  # kept for the backward pass: the weight is converted once a call, not twice
  return _f32_dot(x, low, 1, 0).astype(x.dtype), (x, low, jnp.zeros((0,), w.dtype))


def _cpu_matmul_bwd(residuals, g):
  x, low, w_dtype = residuals
  g = g.astype(x.dtype)
  dx = _f32_dot(g, low, 1, 1).astype(x.dtype)
  dw = _f32_dot(rows_first(x), g, 1, 0).astype(w_dtype.dtype)
  return dx, dw


cpu_low_precision_matmul.defvjp(_cpu_matmul_fwd, _cpu_matmul_bwd)


def project(module: nnx.Module, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`tokens_matmul(x, w)` for the module's projection `name` (w its kernel as [in, out]), plus the projection's
  low-rank adapter where one is attached (`models.lora`: the attribute `name + "_lora"`)."""
  out = tokens_matmul(x, w)
  adapter = getattr(module, name + "_lora", None)
  return out if adapter is None else out + adapter(x)


class Attention(nnx.Module):
  """Grouped-query attention with rotary embeddings over an optional KV cache of one layer: the layer's own rope base
  and scaling (`ModelConfig.layer_rope`), q/k norms where the family has them, and its logit scale."""

  def __init__(self, config: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs):
    h, d, q, kv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    self.config, self.layer = config, layer
    self.q_proj = _param(rngs, config, (h, q, d), ("embed", "heads", "head_dim"))
    self.k_proj = _param(rngs, config, (h, kv, d), ("embed", "kv_heads", "head_dim"))
    self.v_proj = _param(rngs, config, (h, kv, d), ("embed", "kv_heads", "head_dim"))
    self.o_proj = _param(rngs, config, (q, d, h), ("heads", "head_dim", "embed"))
    if config.qkv_bias:
      self.q_bias = _constant(config, (q, d), ("heads", "head_dim"), 0.0)
      self.k_bias = _constant(config, (kv, d), ("kv_heads", "head_dim"), 0.0)
      self.v_bias = _constant(config, (kv, d), ("kv_heads", "head_dim"), 0.0)
    if config.o_bias:
      self.o_bias = _constant(config, (h,), ("embed",), 0.0)
    if config.qk_norm:
      self.q_norm, self.k_norm = RMSNorm(config, d), RMSNorm(config, d)

  def _project(self, x, name, bias_name):
    w = getattr(self, name)[...]
    out = project(self, name, x, w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])
    if self.config.qkv_bias:
      out = out + getattr(self, bias_name)[...].astype(x.dtype)
    return out

  def __call__(self, x, positions, mask, kv_cache=None):
    """x [B, T, H]; mask [B, T, S] says which keys each query sees (without a cache, a `SegmentMask` instead: the
    fused kernel computes the attention).

    Without a cache the keys are the chunk itself (S = T). With a layer cache (`kv_cache.ContiguousLayer`,
    `paged_cache.PagedLayer`: anything with `attend(q, k, v, mask) -> (cache, out)`), the cache writes the
    chunk's keys and values [B, T, kv_heads, head_dim] where it keeps them and attends over what it holds.
    Returns (output [B, T, H], the updated layer cache or None).
    """
    cfg = self.config
    theta, scaling = cfg.layer_rope(self.layer)
    inv_freq = rope_inverse_frequencies(cfg.head_dim, theta, scaling)
    q, k = self._project(x, "q_proj", "q_bias"), self._project(x, "k_proj", "k_bias")
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    # every attention below scales by head_dim ** -0.5 (a fused kernel's too): a family's own scale goes into q
    factor = cfg.query_scale * math.sqrt(cfg.head_dim) if cfg.query_scale else 1.0
    if factor != 1.0:
      q = q * jnp.asarray(factor, q.dtype)
    v = self._project(x, "v_proj", "v_bias")
    if kv_cache is None and isinstance(mask, SegmentMask):  # the fused kernel computes it
      out = mask.attend(q, k, v)
    elif kv_cache is None:
      out = grouped_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
    else:
      kv_cache, out = kv_cache.attend(q, k, v, mask)
    w = self.o_proj[...]
    out = project(self, "o_proj", out.reshape(*out.shape[:-2], -1), w.reshape(-1, w.shape[-1]))
    if self.config.o_bias:
      out = out + self.o_bias[...].astype(x.dtype)
    return out, kv_cache


def grouped_attention(q, k, v, mask):
  """Softmax attention; q [B, T, Hq, D], k/v [B, Hkv, S, D], mask [B, T, S]; softmax in float32."""
  b, t, hq, d = q.shape
  groups = hq // k.shape[1]
  q = q.reshape(b, t, k.shape[1], groups, d)
  if t == 1:  # decode: multiply-and-reduce fuses into one pass over the cache; tiny batched dots do not
    scores = jnp.sum(q[:, 0, :, :, None, :] * k[:, :, None, :, :], axis=-1)[:, :, :, None, :]
  else:
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores.astype(jnp.float32) / math.sqrt(d)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  if t == 1:
    return jnp.sum(probs[:, :, :, 0, :, None] * v[:, :, None], axis=-2).reshape(b, 1, hq, d)
  return jnp.einsum("bkgts,bksd->btkgd", probs, v).reshape(b, t, hq, d)


def gate_activation(name: str):
  """The MLP gate's activation: silu (Llama, Qwen) or the tanh approximation of gelu (Gemma)."""
  return jax.nn.silu if name == "silu" else functools.partial(jax.nn.gelu, approximate=True)


class MLP(nnx.Module):
  """Gated feed-forward: down(act(gate(x)) * up(x)), act silu (SwiGLU) or gelu-tanh (GeGLU)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    h, i = config.hidden_size, config.intermediate_size
    self.act = config.hidden_act
    self.gate_proj = _param(rngs, config, (h, i), ("embed", "mlp"))
    self.up_proj = _param(rngs, config, (h, i), ("embed", "mlp"))
    self.down_proj = _param(rngs, config, (i, h), ("mlp", "embed"))

  def __call__(self, x):
    gate = project(self, "gate_proj", x, self.gate_proj[...])
    up = project(self, "up_proj", x, self.up_proj[...])
    return project(self, "down_proj", gate_activation(self.act)(gate) * up, self.down_proj[...])
