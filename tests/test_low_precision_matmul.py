"""bfloat16 products on a CPU (`layers.cpu_low_precision_matmul`, `rows_first`): the values and gradients of the
float64 product of the same bfloat16-rounded numbers, within bfloat16's rounding of the result; the weight's
gradient in its own (float32) dtype; the chunked log-probabilities' head gradient through the same path; the norm's
scale and its gradient (`layers.scaled`) and the rotary embedding's (`layers.apply_rope`) against numpy. And the
decode side: a bfloat16 table gathered bit for bit, a float32 cache under bfloat16 compute, the tied head."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.kv_cache import KVCache, kv_cache_bytes
from streamrl_jax.models.layers import (MLP, apply_rope, cache_dtype, rope_inverse_frequencies, rows_first, scaled,
                                       take_rows, tokens_matmul)
from streamrl_jax.training.logprobs import chunked_token_logprobs
from tests.xla_flags import USERS_COMPILER


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


def test_a_bfloat16_mlp_on_a_cpu_matches_float64_within_bfloat16_rounding():
  config = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                       dtype="bfloat16")
  from flax import nnx
  mlp = MLP(config, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 64)), jnp.bfloat16)
  gate, up, down = (_bf16(np.asarray(p[...], np.float64)) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
  xb = np.asarray(x, np.float64)
  a, b = xb @ gate, xb @ up
  hidden = _bf16(a / (1 + np.exp(-a)) * b)  # one rounding, of silu(gate) * up
  got = np.asarray(nnx.jit(lambda m, x: m(x))(mlp, x), np.float64)
  np.testing.assert_allclose(got, _bf16(hidden @ down), rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_norm_scale_and_its_gradient_against_numpy(dtype):
  rng = np.random.default_rng(5)
  scale = rng.normal(size=16).astype(np.float32)
  normed = jnp.asarray(rng.normal(size=(3, 7, 16)), dtype)
  g = rng.normal(size=(3, 7, 16)).astype(np.float32)
  n64, g64 = np.asarray(normed, np.float64), np.asarray(jnp.asarray(g, dtype), np.float64)
  out = jax.jit(scaled)(jnp.asarray(scale), normed)
  assert out.dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(jnp.asarray(scale, dtype), np.float64) * n64,
                             rtol=tol, atol=tol)
  d_scale, d_normed = jax.jit(jax.grad(lambda s, n: jnp.sum(scaled(s, n) * jnp.asarray(g, dtype)), argnums=(0, 1)))(
      jnp.asarray(scale), normed)
  assert d_scale.dtype == jnp.float32 and d_normed.dtype == dtype
  np.testing.assert_allclose(np.asarray(d_scale), (g64 * n64).sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(d_normed, np.float64), g64 * np.asarray(jnp.asarray(scale, dtype), np.float64),
                             rtol=tol, atol=tol)


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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_take_rows_is_the_gather_bit_for_bit(dtype):
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.normal(size=(50, 12)), dtype).at[3, 0].set(jnp.nan).at[4, 1].set(-0.0)
  ids = jnp.asarray([3, 0, 49, 4, 3], jnp.int32)
  got = np.asarray(jax.jit(take_rows)(table, ids))
  want = np.asarray(table)[np.asarray(ids)]
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # NaN and -0 included


def _table_copies(gather, vocab: int = 4096, width: int = 64) -> list[str]:
  """The optimized HLO's instructions making a whole [vocab, width] array in a 4-step loop of `gather` calls that
  feed each step's ids from the rows taken (a decode call's shape): parameters and pass-throughs aside."""
  def run(table, ids):
    def body(_, ids):
      return (ids + gather(table, ids)[:, 0].astype(jnp.int32) + 1) % vocab
    return jax.lax.fori_loop(0, 4, body, ids)
  table = jnp.zeros((vocab, width), jnp.bfloat16)
  hlo = jax.jit(run).lower(table, jnp.arange(8, dtype=jnp.int32)).compile(USERS_COMPILER).as_text()
  made = re.compile(rf"= \w+\[{vocab},{width}\]\S* (\w[\w-]*)\(")
  passing = {"parameter", "get-tuple-element", "tuple", "bitcast", "opt-barrier"}
  copies, fused = [], False
  for line in hlo.splitlines():
    if line.startswith("%") or line.startswith("ENTRY"):  # a computation opens: a fusion's body computes per element
      fused = line.startswith(("%fused", "%wrapped"))
    elif not fused and (m := made.search(line)) and m.group(1) not in passing:
      copies.append(line.strip())
  return copies


def test_take_rows_in_a_decode_loop_copies_no_table():
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's loop hoisting")
  assert _table_copies(take_rows) == []
  # the gather as bits, without the barrier (the rule before): the table's bits copied out of the loop each call
  bits = lambda t, i: jax.lax.bitcast_convert_type(jnp.take(jax.lax.bitcast_convert_type(t, jnp.uint16), i, axis=0),
                                                  t.dtype)
  assert _table_copies(bits) != []


def test_a_bfloat16_run_on_a_cpu_caches_in_float32():
  assert cache_dtype("bfloat16") == jnp.float32 and cache_dtype("float32") == jnp.float32
  config = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       dtype="bfloat16")
  cache = KVCache.init(config, batch=2, max_len=8)
  assert cache.keys[0].dtype == jnp.float32
  assert kv_cache_bytes(config, 2, 8) == sum(k.nbytes + v.nbytes for k, v in zip(cache.keys, cache.values))


def test_bfloat16_tied_head_matches_float64():
  from flax import nnx

  from streamrl_jax.models.transformer import Transformer
  config = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                       dtype="bfloat16", tie_embeddings=True)
  model = Transformer(config, rngs=nnx.Rngs(0))
  hidden = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 32)), jnp.bfloat16)
  got = np.asarray(model.head_logits(hidden))
  want = np.asarray(hidden, np.float64) @ _bf16(np.asarray(model.embed[...])).T
  assert got.dtype == np.float32 and got.shape == (2, 3, 48)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_trainers_low_copy_changes_no_gradient_and_follows_the_weights():
  """A bfloat16 trainer on a CPU multiplies a copy of its weights made once per update (`training.low_copy`): its
  accumulated gradient is the one computed converting the weights in every call, in float32, and after an update
  the copy is made again from the new weights."""
  import dataclasses

  from flax import nnx

  from streamrl_jax.models.transformer import Transformer
  from streamrl_jax.training.low_copy import LowCopy
  from tests.trainer_setup import CONFIG, make_batch, trainer_for
  graphdef, params = nnx.split(Transformer(dataclasses.replace(CONFIG, dtype="bfloat16"), rngs=nnx.Rngs(0)))
  batch = make_batch(8, seed=3)
  with_copy, without = trainer_for(graphdef), trainer_for(graphdef)
  state, plain = with_copy.init_state(params), without.init_state(params)
  without.low_copy = LowCopy()  # off: every call converts the float32 weights itself
  assert with_copy.low_copy.on
  state, plain = with_copy.accumulate(state, batch), without.accumulate(plain, batch)
  for a, b in zip(jax.tree.leaves(state.grad_sum), jax.tree.leaves(plain.grad_sum)):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  copy = with_copy.low_copy.of(state.params)
  assert copy is with_copy.low_copy.of(state.params)  # one conversion per set of weights
  assert copy["layers"][0]["mlp"]["up_proj"][...].dtype == jnp.bfloat16
  assert copy["embed"][...].dtype == jnp.float32  # gathered: not copied
  state, _ = with_copy.apply(state)
  new = with_copy.low_copy.of(state.params)["layers"][0]["mlp"]["up_proj"][...]
  np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(
      state.params["layers"][0]["mlp"]["up_proj"][...].astype(jnp.bfloat16), np.float32))
  f32_graphdef, f32_params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  f32 = trainer_for(f32_graphdef)
  f32_state = f32.init_state(f32_params)
  assert f32.low_copy.of(f32_state.params) is None  # float32 computes from the weights themselves


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_rope_and_its_gradient_rotate_each_pair_by_its_angle(dtype, tol):
  """`apply_rope` (its backward written by hand) against numpy's rotation of each (i, i + half) pair by
  position x inverse frequency, and the gradient against the rotation by the opposite angle."""
  rng = np.random.default_rng(7)
  x = rng.normal(size=(2, 5, 3, 8))
  g = rng.normal(size=x.shape)
  positions = rng.integers(0, 50, size=(2, 5))
  inv_freq = rope_inverse_frequencies(8, 1e4, None)
  theta = positions[..., None, None] * inv_freq.astype(np.float64)  # [2, 5, 1, 4]
  cos, sin = np.cos(theta), np.sin(theta)

  def turned(a, sign):  # each pair rotated by sign x its angle
    a1, a2 = a[..., :4], a[..., 4:]
    return np.concatenate([a1 * cos - sign * a2 * sin, a2 * cos + sign * a1 * sin], axis=-1)

  out, pull = jax.vjp(lambda a: apply_rope(a, jnp.asarray(positions), inv_freq), jnp.asarray(x, dtype))
  (grad,) = pull(jnp.asarray(g, dtype))
  np.testing.assert_allclose(np.asarray(out, np.float64), turned(x, 1), atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(grad, np.float64), turned(g, -1), atol=tol, rtol=tol)
