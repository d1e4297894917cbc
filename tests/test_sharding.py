"""The model on a mesh of 8 forced host devices computes what it computes on one device."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from streamrl_jax.models import ModelConfig, Transformer, load_hf, logical_spec, shard_model


def _mesh(data, fsdp, tensor):
  devices = np.array(jax.devices()[: data * fsdp * tensor]).reshape(data, fsdp, tensor)
  return Mesh(devices, ("data", "fsdp", "tensor"))


def test_rules_drop_axes_that_do_not_divide():
  mesh = _mesh(2, 2, 2)
  assert logical_spec(("embed", "mlp"), (64, 96), mesh) == PartitionSpec("fsdp", "tensor")
  assert logical_spec(("embed", "kv_heads", "head_dim"), (64, 1, 24), mesh) == PartitionSpec("fsdp", None, None)
  assert logical_spec(("batch", None), (8, 3), mesh) == PartitionSpec(("data", "fsdp"), None)


def test_sharded_forward_equals_unsharded(hf_dirs):
  model = load_hf(hf_dirs["qwen2"][0])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, 16)), jnp.int32)
  expected = np.asarray(model(tokens))
  mesh = _mesh(2, 2, 2)
  sharded = shard_model(model, mesh)
  assert sharded.layers[0].mlp.up_proj[...].sharding.spec == PartitionSpec("fsdp", "tensor")
  graphdef, state = nnx.split(sharded)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
  np.testing.assert_allclose(np.asarray(forward(state, batch)), expected, atol=1e-5, rtol=1e-5)


def test_load_hf_places_parameters_on_mesh(hf_dirs):
  mesh = _mesh(1, 4, 2)
  model = load_hf(hf_dirs["llama"][0], mesh=mesh)
  assert model.embed[...].sharding.spec == PartitionSpec(None, "fsdp")  # vocab 97 is prime: replicated
  assert model.layers[1].attn.q_proj[...].sharding.spec == PartitionSpec("fsdp", "tensor", None)


def test_random_init_carries_logical_axes_on_every_parameter():
  config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, qkv_bias=True)
  state = nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert leaves and all(len(v.get_metadata()["logical_axes"]) == v.ndim for v in leaves)
  assert sum(v.size for v in leaves) == config.param_count()


def test_remat_gives_the_same_gradients():
  import dataclasses
  config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 32

  def grads(cfg):
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)))
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)  # noqa: E731
    return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

  for plain, remat in zip(grads(config), grads(dataclasses.replace(config, remat=True))):
    np.testing.assert_allclose(remat, plain, rtol=1e-5, atol=1e-7)


def test_optimizer_moments_are_sharded_like_their_parameters():
  """Adam's moments take their parameter's sharding (left to XLA they landed on one device and were then replicated
  on every trainer device: 8 bytes a parameter on each), in a real state and in a plan's state of shapes alike."""
  from streamrl_jax.training import Trainer, TrainerConfig
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  cfg = TrainerConfig()
  mesh = _mesh(1, 4, 1)
  trainer = Trainer(graphdef, cfg.optimizer, cfg.objective, mesh, config=cfg)
  state = trainer.init_state(params)
  shapes = trainer.abstract_state(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  adam = state.opt_state[1][0]
  param_specs = jax.tree.map(lambda p: p.sharding.spec, state.params)
  for moments in (adam.mu, adam.nu):
    assert jax.tree.map(lambda m: m.sharding.spec, moments) == param_specs
  assert adam.mu["embed"].sharding.spec == PartitionSpec(None, "fsdp")
  assert adam.mu["embed"].addressable_shards[0].data.shape == (64, 8)  # a quarter on each device
  assert jax.tree.map(lambda x: x.sharding, shapes) == jax.tree.map(lambda x: x.sharding, state)
