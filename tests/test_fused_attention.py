"""The trainer's fused attention (Pallas splash attention, interpret mode on the CPU) against XLA's: forward and
gradient, packed segments, sliding windows, grouped heads, rows not a multiple of the kernel's tile, split over a
mesh's batch and tensor axes; and a whole model's hidden states and parameter gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.models.activation_layout import ActivationLayout
from streamrl_jax.models.fused_attention import AttentionKernel, segment_attention, trainer_kernel
from streamrl_jax.models.layers import grouped_attention
from streamrl_jax.models.compile_target import compiling_for

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _mesh(data, fsdp, tensor):
  return Mesh(np.array(jax.devices()[:data * fsdp * tensor]).reshape(data, fsdp, tensor), ("data", "fsdp", "tensor"))


def _segments(batch, length, seed):
  """Rows of 2-3 packed samples and padding after them (segment 0)."""
  rng = np.random.default_rng(seed)
  out = np.zeros((batch, length), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(8, length - 8), 2, replace=False))
    out[row, :cuts[0]], out[row, cuts[0]:cuts[1]] = 1, 2
    out[row, cuts[1]:length - 5] = 3
  return out


def _xla(q, k, v, segments, window):
  steps = jnp.arange(q.shape[1])
  attend = (steps[None, :] <= steps[:, None])[None] & (segments[:, None, :] == segments[:, :, None])
  if window is not None:
    attend = attend & ((steps[:, None] - steps[None, :]) < window)[None]
  return grouped_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), attend)


@pytest.mark.parametrize("dtype,window,mesh_shape", [(jnp.float32, None, (1, 2, 1)), (jnp.float32, 24, (1, 1, 2)),
                                                     (jnp.bfloat16, 24, (2, 1, 2))])
def test_segment_attention_matches_xla_forward_and_gradient(dtype, window, mesh_shape):
  batch, length, heads, kv_heads, dim = 2, 100, 4, 2, 16  # 100: padded to the kernel's tile of 128 and cut back
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, h, dim)), dtype) for h in (heads, kv_heads, kv_heads))
  segments = jnp.asarray(_segments(batch, length, 1))
  real = (segments > 0)[..., None, None]  # padding tokens' outputs are never read
  cotangent = jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32) * real
  kernel = AttentionKernel(_mesh(*mesh_shape), interpret=True)
  ours = lambda q, k, v: segment_attention(q, k, v, segments, window, kernel)  # noqa: E731
  theirs = lambda q, k, v: _xla(q, k, v, segments, window)  # noqa: E731
  tol = TOLERANCE[dtype]
  np.testing.assert_allclose(np.asarray(ours(q, k, v) * real, np.float32),
                             np.asarray(theirs(q, k, v) * real, np.float32), atol=tol, rtol=tol)
  loss = lambda f: lambda *x: jnp.sum(f(*x).astype(jnp.float32) * cotangent)  # noqa: E731
  for mine, reference in zip(jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v),
                             jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(np.asarray(mine, np.float32), np.asarray(reference, np.float32), atol=tol, rtol=tol)


def test_model_with_the_kernel_equals_xla_attention_with_windows_and_packing():
  """Gemma 3's switches (sliding and full layers, q/k norms, sandwich norms): hidden states of packed rows and every
  parameter's gradient equal with the kernel and with XLA's attention."""
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, architecture="gemma3", qk_norm=True, norm_offset=1.0, sandwich_norms=True,
                       embed_scale=True, hidden_act="gelu_tanh", layer_types=("sliding", "full"), sliding_window=16)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  segments = jnp.asarray(_segments(2, 64, 3))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 64)), jnp.int32)
  mesh = _mesh(1, 2, 1)
  kernel = ActivationLayout(mesh, AttentionKernel(mesh, interpret=True))
  # a random direction: the sum of squares of normed states is nearly constant (its gradient is rounding noise)
  direction = jnp.asarray(np.random.default_rng(5).normal(size=(2, 64, 32)), jnp.float32) * (segments > 0)[..., None]

  def loss(params, kernel):
    hidden, _ = nnx.merge(graphdef, params).hidden_and_routing(tokens, segments > 0, segments, layout=kernel)
    return jnp.sum(hidden * direction), hidden

  (mine, hidden), grads = jax.value_and_grad(loss, has_aux=True)(params, kernel)
  (theirs, reference), expected = jax.value_and_grad(loss, has_aux=True)(params, None)
  real = np.asarray(segments > 0)
  np.testing.assert_allclose(np.asarray(hidden)[real], np.asarray(reference)[real], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(float(mine), float(theirs), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):  # within 1e-5 of each tensor's scale
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * float(np.abs(b).max()), rtol=1e-5)


def test_auto_takes_the_kernel_only_on_a_tpu():
  mesh = _mesh(1, 1, 1)
  assert trainer_kernel("auto", mesh) is None and trainer_kernel("xla", mesh) is None
  assert trainer_kernel("splash", mesh) == AttentionKernel(mesh, interpret=True)
  with compiling_for("tpu"):
    assert trainer_kernel("auto", mesh) == AttentionKernel(mesh, interpret=False)
  with pytest.raises(ValueError, match="TrainerConfig.attention='flash'"):
    trainer_kernel("flash", mesh)
