"""Routing replay on a tiny mixture of experts, end to end: both engines record the experts each token was routed to
(the same a full forward chooses), the routes travel in the shard, and the trainer replays them: with equal weights
the agreement is 1 and the log-probabilities are the sampler's; where the sampler breaks a router tie the other way,
only the replayed trainer computes the sampler's log-probabilities."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.pipeline.sampler.groups import samples_to_shard
from streamrl_jax.rewards.scorer import Score
from streamrl_jax.sampling import EngineConfig, StreamingSampler
from streamrl_jax.sampling.engines import make_engine
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Trainer
from streamrl_jax.types import SamplingParams

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                     architecture="qwen3_moe", qk_norm=True, num_experts=6, experts_per_token=2,
                     moe_intermediate_size=16, norm_topk_prob=True, dense_layers=(1,), router_aux_loss_coef=0.01)
ENGINES = {"contiguous": EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=12, min_prefill_bucket=16),
           "paged": EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=12, min_prefill_bucket=16,
                                 kv_layout="paged", page_size=4)}
PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4, 60, 61, 62, 70, 3, 11]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, num_samples=2)


def model_params(config=CONFIG, seed=0):
  """A random model whose routers have clear margins (scaled up)."""
  model = Transformer(config, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model)
  for layer in config.moe_layers:
    router = params["layers"][layer]["mlp"]["router"]
    router[...] = router[...] * 40.0
  return graphdef, params


def sample_all(graphdef, params, config, layout="contiguous"):
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  sampler = StreamingSampler([make_engine(graphdef, config, ENGINES[layout], mesh)], params, seed=1)
  for group, prompt in enumerate(PROMPTS):
    sampler.submit(prompt, SAMPLING, group_id=group)
  return sorted(sampler.stream(), key=lambda s: (s.group_id, s.sample_index))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_both_engines_record_the_routes_a_full_forward_chooses(layout):
  graphdef, params = model_params()
  samples = sample_all(graphdef, params, CONFIG, layout)
  trace = jax.jit(lambda p, t: nnx.merge(graphdef, p).hidden_and_routing(t)[1].experts)
  for s in samples:
    tokens = np.concatenate([s.prompt_tokens, s.completion_tokens])
    assert s.routes.shape == (len(tokens), 2, 2) and s.routes.dtype == np.int16
    assert not s.routes[-1].any() and (s.routes[:-1] > 0).all()  # the last token: no step read it
    own = np.sort(np.asarray(trace(params, jnp.asarray(tokens[None])))[0], axis=-1)
    np.testing.assert_array_equal(np.sort(s.routes[:-1], axis=-1) - 1, own[:-1])


def trained_metrics(graphdef, params, shard, replay: str) -> dict:
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=1e-3), ObjectiveConfig(routing_replay=replay,
                                                                                   terms=("load_balancing",)), mesh)
  state = trainer.accumulate(trainer.init_state(params), shard.train_batch(np.linspace(-1, 1, shard.num_samples)))
  return trainer.apply(state)[1]


def shard_of(samples):
  scores = [Score(total=0.0, parts=(0.0,)) for _ in samples]
  return samples_to_shard(samples, scores, width=32, step=0)


def test_equal_weights_agree_and_the_trainer_scores_as_the_sampler():
  graphdef, params = model_params()
  shard = shard_of(sample_all(graphdef, params, CONFIG))
  assert shard.routes.shape == (4, 32, 2, 2)
  for replay in ("off", "replay"):
    metrics = trained_metrics(graphdef, params, shard, replay)
    assert metrics["router_agreement"] == 1.0, replay
    assert metrics["logprob_mismatch_max"] < 1e-4, replay
    assert metrics["objective_terms"] > 0  # the load-balancing term is in the loss
  # routes not recorded (a prompt's, mid-row): those tokens go where the trainer's router sends them
  holes = shard.routes.copy()
  holes[:, 2:9] = 0
  metrics = trained_metrics(graphdef, params, dataclasses.replace(shard, routes=holes), "replay")
  assert metrics["logprob_mismatch_max"] < 1e-4 and metrics["router_agreement"] == 1.0


def test_a_tie_the_sampler_breaks_the_other_way_is_replayed():
  """One expert routing: experts 0 and 1 have the same router column in the trainer (a tie its top-1 breaks to 0),
  and the sampler's column 1 is larger by a part in a million (it picks 1). Replay uses the sampler's expert."""
  config = dataclasses.replace(CONFIG, experts_per_token=1)
  graphdef, params = model_params(config, seed=2)
  for layer in config.moe_layers:  # experts 0 and 1 lead every token they do not turn away, tied; 1 is louder
    mlp = params["layers"][layer]["mlp"]
    column = jnp.abs(mlp["router"][...][:, :1]) * 10.0 + 1.0
    mlp["router"][...] = mlp["router"][...].at[:, :2].set(column)
    mlp["down_proj"][...] = mlp["down_proj"][...].at[1].multiply(10.0)
  sampler_params = jax.tree.map(lambda x: x, params)
  for layer in config.moe_layers:
    router = sampler_params["layers"][layer]["mlp"]["router"]
    router[...] = router[...].at[:, 1].multiply(1 + 1e-6)
  shard = shard_of(sample_all(graphdef, sampler_params, config))
  replayed, own = (trained_metrics(graphdef, params, shard, r) for r in ("replay", "off"))
  assert own["router_agreement"] < 0.9 and replayed["router_agreement"] < 0.9  # its own choices differ either way
  assert replayed["logprob_mismatch_max"] < 1e-4 and own["logprob_mismatch_max"] > 0.05
