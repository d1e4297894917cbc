"""bfloat16 products on a CPU (`layers.cpu_low_precision_matmul`, `rows_first`): the values and gradients of the
float64 product of the same bfloat16-rounded numbers, within bfloat16's rounding of the result; the weight's
gradient in its own (float32) dtype; the chunked log-probabilities' head gradient through the same path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax.models.layers import rows_first, tokens_matmul
from streamrl_jax.training.logprobs import chunked_token_logprobs


def _bf16(a: np.ndarray) -> np.ndarray:
  """`a` rounded to bfloat16, back in float64."""
  return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("shape", [(12, 64), (5, 24), (3, 7)])
def test_rows_first_is_the_transpose(shape):
  a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  np.testing.assert_array_equal(np.asarray(jax.jit(rows_first)(jnp.asarray(a))), a.T)


@pytest.mark.parametrize("hidden", [64, 40])  # 40: no 64-column block
def test_bfloat16_tokens_matmul_matches_float64_in_value_and_gradient(hidden):
  assert jax.default_backend() == "cpu"
  rng = np.random.default_rng(hidden)
  x = rng.normal(size=(2, 6, hidden)).astype(np.float32)
  w = rng.normal(size=(hidden, 24)).astype(np.float32) * 0.2
  g = rng.normal(size=(2, 6, 24))
  xb, wb = _bf16(x), _bf16(w)
  out = jax.jit(tokens_matmul)(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float64), xb @ wb, rtol=1e-2, atol=1e-2)

  def loss(x, w):
    return jnp.sum(tokens_matmul(x, w).astype(jnp.float32) * g)
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w))
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32  # the weight's gradient never rounded to bfloat16
  gb = _bf16(g)  # the cotangent reaches the products in bfloat16
  np.testing.assert_allclose(np.asarray(dx, np.float64), gb @ wb.T, rtol=1e-2, atol=3e-2)
  want_dw = np.einsum("bti,bto->io", xb, gb)
  np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4)


def test_bfloat16_chunked_logprobs_head_gradient_matches_float32():
  rng = np.random.default_rng(0)
  hidden = _bf16(rng.normal(size=(2, 8, 64)) * 0.5).astype(np.float32)
  head = _bf16(rng.normal(size=(96, 64)) * 0.5).astype(np.float32)  # tied embeddings [vocab, hidden]
  tokens = jnp.asarray(rng.integers(0, 96, size=(2, 8)), jnp.int32)

  def loss(h, w):
    return jnp.sum(chunked_token_logprobs(h, w, tokens, 1.0, 32, vocab_axis=0)[0])
  want = jax.grad(loss, argnums=1)(jnp.asarray(hidden), jnp.asarray(head))
  got = jax.grad(loss, argnums=1)(jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(head, jnp.bfloat16))
  assert np.abs(np.asarray(want)).max() > 0.1
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=0.05, atol=0.02)
