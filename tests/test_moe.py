"""A mixture of experts against numpy and transformers: routing (top k, renormalised), the routed experts' MLPs by
blocks and by ragged products (values and gradients), replayed routes, the load-balancing loss, experts split over a
mesh axis, and a decode step that multiplies no expert it did not route to."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.models.moe import (ExpertPlacement, MoeMLP, load_balancing_loss, replayed, route, routed_experts)
from tests.xla_flags import USERS_COMPILER

H, I = 8, 6


def silu(x):
  return x / (1 + np.exp(-x))


def numpy_mixture(x, experts, weights, gate, up, down):
  """sum_j weights[n, j] * down_e(silu(gate_e x) * up_e x), e = experts[n, j]; ids outside [0, E) add nothing."""
  out = np.zeros_like(x, dtype=np.float64)
  for n in range(x.shape[0]):
    for e, w in zip(experts[n], weights[n]):
      if 0 <= e < gate.shape[0]:
        out[n] += w * ((silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e])
  return out


def expert_weights(rng, e):
  return tuple(rng.standard_normal(shape).astype(np.float32) * 0.5 for shape in ((e, H, I), (e, H, I), (e, I, H)))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 12), e=st.integers(1, 6), data=st.data())
def test_routed_experts_equal_numpy_by_blocks_and_by_ragged_products(n, e, data):
  k = data.draw(st.integers(1, e))
  rng = np.random.default_rng(n * 31 + e)
  x = rng.standard_normal((n, H)).astype(np.float32)
  # distinct experts per row, some of another device's (ids past E): they add nothing
  experts = np.stack([rng.choice(e + 2, size=k, replace=False) for _ in range(n)]).astype(np.int32)
  weights = rng.random((n, k)).astype(np.float32)
  ws = expert_weights(rng, e)
  want = numpy_mixture(x, experts, weights, *ws)
  for method in ("blocks", "ragged"):
    got = jax.jit(routed_experts, static_argnums=(4, 5))(x, experts, weights, ws, "silu", method)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5, err_msg=method)


def test_gradients_by_blocks_equal_those_of_a_dense_mixture():
  rng = np.random.default_rng(0)
  n, e, k = 10, 4, 2
  x = jnp.asarray(rng.standard_normal((n, H)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]), jnp.int32)
  weights = jnp.asarray(rng.random((n, k)), jnp.float32)
  ws = tuple(map(jnp.asarray, expert_weights(rng, e)))

  def dense(x, weights, gate, up, down):  # every expert on every row, weighted by a one-hot of the routes
    every = jnp.einsum("nei,eij->nej", jax.nn.silu(jnp.einsum("nh,ehi->nei", x, gate)) * jnp.einsum("nh,ehi->nei", x, up),
                       down)
    mix = jnp.sum(jax.nn.one_hot(experts, e) * weights[..., None], axis=1)
    return jnp.sum(every * mix[..., None], axis=1)

  def loss(fn):
    return lambda x, w, g, u, d: jnp.sum(jnp.sin(fn(x, w, g, u, d)))
  ours = jax.jit(jax.grad(loss(lambda x, w, g, u, d: routed_experts(x, experts, w, (g, u, d), "silu", "blocks")),
                          argnums=range(5)))(x, weights, *ws)
  theirs = jax.jit(jax.grad(loss(dense), argnums=range(5)))(x, weights, *ws)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_routing_is_the_softmax_top_k_renormalised_and_replay_reweights_given_experts():
  logits = np.array([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.5, 0.4]], np.float32)
  probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  weights, experts, p = route(jnp.asarray(logits), 2, normalize=False)
  np.testing.assert_array_equal(np.asarray(experts), [[1, 3], [0, 2]])
  np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(experts), 1), rtol=1e-6)
  normed, _, _ = route(jnp.asarray(logits), 2, normalize=True)
  np.testing.assert_allclose(np.asarray(normed).sum(1), 1.0, rtol=1e-6)
  given_experts = np.array([[2, 0], [3, 1]], np.int32)
  want = np.take_along_axis(probs, given_experts, 1)
  np.testing.assert_allclose(np.asarray(replayed(p, jnp.asarray(given_experts), True)),
                             want / want.sum(1, keepdims=True), rtol=1e-6)


def tiny_moe(**changes) -> ModelConfig:
  fields = dict(vocab_size=32, hidden_size=H, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1,
                architecture="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2, moe_intermediate_size=I,
                norm_topk_prob=True)
  return ModelConfig(**{**fields, **changes})


def test_a_replayed_layer_uses_the_given_experts_and_its_own_router_probabilities():
  layer = MoeMLP(tiny_moe(), rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(1), (2, 5, H))
  call = nnx.jit(lambda layer, x, routes: layer(x, routes=routes))
  own, trace = call(layer, x, None)
  same, _ = call(layer, x, trace.experts)  # replaying its own choices changes nothing
  np.testing.assert_allclose(np.asarray(same), np.asarray(own), atol=1e-6)
  other = (trace.experts + 1) % 4  # every token to other experts
  replay, again = call(layer, x, other)
  np.testing.assert_array_equal(np.asarray(again.experts), np.asarray(trace.experts))  # its own choices, reported
  flat = np.asarray(x).reshape(10, H)
  probs = jax.nn.softmax(flat @ np.asarray(layer.router[...]), axis=-1)
  w = np.take_along_axis(np.asarray(probs), np.asarray(other).reshape(10, 2), 1)
  ws = tuple(np.asarray(p[...]) for p in (layer.gate_proj, layer.up_proj, layer.down_proj))
  want = numpy_mixture(flat, np.asarray(other).reshape(10, 2), w / w.sum(1, keepdims=True), *ws)
  np.testing.assert_allclose(np.asarray(replay).reshape(10, H), want, atol=1e-5)
  # the router learns under replay: its gradient is not zero
  grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, routes=other)[0] ** 2)))(layer)
  assert float(jnp.abs(grad.router[...]).sum()) > 0


def test_load_balancing_loss_equals_transformers_on_masked_tokens():
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

  config = tiny_moe(num_layers=3, num_experts=6, experts_per_token=2, norm_topk_prob=False)
  model = Transformer(config, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, 32)
  valid = np.ones((2, 7), bool)
  valid[1, :3] = False  # left padding

  @nnx.jit
  def both(model, tokens, valid):
    trace = model.hidden_and_routing(tokens, valid)[1]
    # each sparse layer's router logits, as transformers records them
    return trace, [_router_input(model, tokens, valid, i) @ layer.mlp.router[...] for i, layer in enumerate(model.layers)]
  trace, logits = both(model, tokens, jnp.asarray(valid))
  ours = load_balancing_loss(trace.load, trace.importance, jnp.asarray(valid.sum(), jnp.float32))
  logits = [torch.tensor(np.asarray(x).reshape(-1, 6)) for x in logits]
  theirs = load_balancing_loss_func(tuple(logits), 6, 2, torch.tensor(valid.astype(np.int64)))
  np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)


def _router_input(model, tokens, valid, index):
  """The normed input of layer `index`'s MLP (the router's input), by running the layers before it."""
  mask = valid
  steps = jnp.arange(tokens.shape[1])
  attend = mask[:, None, :] & (steps[None, None, :] <= steps[None, :, None])
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  x = model.embed[...][tokens]
  for layer in model.layers[:index]:
    x, _, _ = layer(x, positions, attend)
  layer = model.layers[index]
  h, _ = layer.attn(layer.attn_norm(x), positions, attend)
  return layer.mlp_norm(x + h)


def test_experts_split_over_a_mesh_axis_give_the_same_values_and_gradients():
  devices = np.asarray(jax.devices()[:4]).reshape(1, 4, 1)
  mesh = Mesh(devices, ("data", "fsdp", "tensor"))
  layer = MoeMLP(tiny_moe(num_experts=8, experts_per_token=3), rngs=nnx.Rngs(5))
  x = jax.random.normal(jax.random.key(2), (4, 6, H))
  graphdef, state = nnx.split(layer)

  def run(state, x, placement):
    out, trace = nnx.merge(graphdef, state)(x, placement=placement)
    return jnp.sum(jnp.tanh(out)), trace.experts

  local = jax.jit(jax.value_and_grad(lambda s, x: run(s, x, None), has_aux=True))
  placement = ExpertPlacement(mesh, "fsdp")
  split = jax.jit(jax.value_and_grad(lambda s, x: run(s, x, placement), has_aux=True))
  on_mesh = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("fsdp") if a.ndim == 3 else
                                                                   PartitionSpec())), state)
  (v1, e1), g1 = local(state, x)
  (v2, e2), g2 = split(on_mesh, jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp"))))
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(e2), np.asarray(e1))
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
  assert math.isfinite(float(v1))


def test_a_decode_step_multiplies_no_expert_it_did_not_route_to():
  """The compiled decode step of a model with 16 experts: no product reads every expert's weights."""
  from streamrl_jax.models import KVCache

  config = tiny_moe(num_experts=16, experts_per_token=2, num_layers=1)
  model = Transformer(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def step(state, tokens, cache):
    return nnx.merge(graphdef, state).forward_with_cache(tokens, cache)[0]
  lowered = jax.jit(step).lower(state, jnp.zeros((4, 1), jnp.int32), KVCache.init(config, 4, 8))
  text = lowered.compile(USERS_COMPILER).as_text()
  dots = [line for line in text.splitlines() if " dot(" in line]
  assert dots
  every_expert = [line for line in dots if f"f32[16,{H},{I}]" in line or f"f32[16,{I},{H}]" in line]
  assert not every_expert, every_expert[:2]
