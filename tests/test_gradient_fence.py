"""The gradient fence (`models.gradient_fence`): an identity whose backward ties each layer's input cotangent to its
trained parameters' cotangents. The gradient is the unfenced one's; the backward holds one barrier a layer over exactly
those cotangents; LoRA's fence holds the adapters' alone (the frozen base gets no gradient)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.models.activation_layout import ActivationLayout
from streamrl_jax.models.lora import LoraConfig, attach

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, num_kv_heads=1)


def _grad(model, trained, wrt):
  """The gradient of a loss on the final hidden states with respect to the `wrt` variables, and its jaxpr."""
  layout = ActivationLayout(mesh_from_devices(jax.devices()[:2], MeshShape(1, 2, 1)), None, trained)
  graphdef, params, rest = nnx.split(model, wrt, ...)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 8)), jnp.int32)

  def loss(params):
    hidden, _ = nnx.merge(graphdef, params, rest).hidden_and_routing(tokens, layout=layout)
    return jnp.sum(hidden.astype(jnp.float32) ** 2)

  return jax.grad(loss)(params), jax.make_jaxpr(jax.grad(loss))(params)


def _barriers(jaxpr) -> list:
  """The operand counts of every optimization barrier in a jaxpr, its inner jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      found.append(len(eqn.invars))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _barriers(sub)
  return found


def _leaves_per_layer(model, kind) -> int:
  return len(jax.tree.leaves(nnx.state(model.layers[0], kind)))


def test_the_fenced_gradient_is_the_unfenced_one_with_a_barrier_a_layer():
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  plain, plain_jaxpr = _grad(model, None, nnx.Param)
  fenced, fenced_jaxpr = _grad(model, nnx.Param, nnx.Param)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
               plain, fenced)
  assert _barriers(plain_jaxpr.jaxpr) == []
  # each layer's barrier: its input's cotangent and one per parameter of the layer
  assert _barriers(fenced_jaxpr.jaxpr) == [1 + _leaves_per_layer(model, nnx.Param)] * CONFIG.num_layers


def test_lora_fences_the_adapters_alone():
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  attach(model, LoraConfig(rank=2))
  plain, _ = _grad(model, None, nnx.LoRAParam)
  fenced, jaxpr = _grad(model, nnx.LoRAParam, nnx.LoRAParam)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
               plain, fenced)
  adapters = _leaves_per_layer(model, nnx.LoRAParam)
  assert 0 < adapters < _leaves_per_layer(model, nnx.Param)
  assert _barriers(jaxpr.jaxpr) == [1 + adapters] * CONFIG.num_layers
