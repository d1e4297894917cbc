"""KL to a frozen reference policy: the penalty and its gradient against numpy, exact under streaming, the
'in the reward' variant, and every run mode training with it."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import mesh_from_devices
from streamrl_jax.models import Transformer
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Scoring, Trainer
from streamrl_jax.workflow import WorkflowConfig
from tests.pipeline_setup import BASE, MODEL, run
from tests.trainer_setup import CONFIG, MESH_SHAPE, make_batch, mean_gradient, split_rows


def numpy_logprobs(graphdef, params, tokens, valid):
  logits = np.asarray(nnx.merge(graphdef, params)(tokens, valid), np.float64)[:, :-1]
  logp_all = logits - logits.max(-1, keepdims=True)
  logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  return np.concatenate([np.zeros((len(tokens), 1)), picked], axis=1)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_equals_numpy_and_streamed_gradients_stay_exact(estimator):
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  _, ref = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(1)))  # a reference that differs from the policy
  mesh = mesh_from_devices(jax.devices()[4:8], MESH_SHAPE)
  objective = ObjectiveConfig(objective="reinforce", correction="none", aggregation="token_mean", kl_coef=0.5,
                              kl_estimator=estimator)
  trainer = Trainer(graphdef, OptimizerConfig(), objective, mesh, scoring=Scoring(ref_params=ref))
  batch = make_batch(13, seed=2)
  full = trainer.accumulate(trainer.init_state(params), batch)

  logp = numpy_logprobs(graphdef, params, batch["tokens"], batch["valid"])
  ref_logp = numpy_logprobs(graphdef, ref, batch["tokens"], batch["valid"])
  np.testing.assert_allclose(trainer.reference_logprobs(batch["tokens"], batch["valid"]), ref_logp, atol=1e-4)
  log_ratio = logp - ref_logp
  kl = log_ratio if estimator == "k1" else np.exp(-log_ratio) + log_ratio - 1.0
  mask = batch["loss_mask"].astype(np.float64)
  per_token = -batch["advantages"][:, None] * logp + 0.5 * kl
  np.testing.assert_allclose(float(full.sums["kl"]) / mask.sum(), (kl * mask).sum() / mask.sum(), rtol=1e-4)
  np.testing.assert_allclose(float(full.sums["numerator"]), (per_token * mask).sum(), rtol=1e-4)
  assert abs((kl * mask).sum()) > 1e-3  # the two policies do differ

  streamed = trainer.init_state(params)
  for part in split_rows(batch, [4, 6, 3]):
    streamed = trainer.accumulate(streamed, part)
  for a, b in zip(jax.tree.leaves(mean_gradient(full)), jax.tree.leaves(mean_gradient(streamed))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "stream", "async"])
def test_every_mode_trains_with_a_kl_penalty(mode):
  result = run(mode, trainer=dataclasses.replace(BASE.trainer, objective=ObjectiveConfig(kl_coef=0.04)), steps=2)
  kl = [m["kl"] for m in result.metrics]
  assert kl[0] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
  assert kl[-1] > 0 and result.counters["samples_trained"] == BASE.samples_per_step * 2


def divergence_from_start(params) -> float:
  """Mean |log pi - log pi_start| over the tokens of a fixed random batch."""
  graphdef, start = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MODEL.vocab_size, (16, 24)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  return float(np.mean(np.abs(numpy_logprobs(graphdef, params, tokens, valid)
                              - numpy_logprobs(graphdef, start, tokens, valid))[:, 1:]))


SHARP = dict(steps=6, trainer=dataclasses.replace(BASE.trainer, optimizer=OptimizerConfig(learning_rate=3e-3)))


@pytest.fixture(scope="module")
def free_run():
  return run("disaggregated", **SHARP)


@pytest.mark.parametrize("in_reward", [False, True])
def test_a_large_kl_coefficient_keeps_the_policy_closer_to_the_reference(in_reward, free_run):
  """In the loss the penalty's gradient pulls every token back: under 0.8 of the free run's divergence (0.53-0.71
  over seeds 1-4). In the reward it only reweights the sampled completions (16 a step), a pull within this run's
  noise (0.79-1.08 over the same seeds): that run is held to carrying the KL into its rows, the reward's arithmetic
  to `tests/test_objectives.py`."""
  free, sharp = free_run, SHARP
  kl = ObjectiveConfig(kl_coef=20.0, kl_in_reward=in_reward)
  graph = WorkflowConfig(graph="kl_reference" if in_reward else "grpo")  # the KL in the reward is that graph's stage
  held = run("disaggregated", **{**sharp, "trainer": dataclasses.replace(sharp["trainer"], objective=kl)},
             workflow=graph)
  assert len(held.metrics) == sharp["steps"] and held.metrics[-1]["kl"] > 0
  if not in_reward:
    assert divergence_from_start(held.params) < 0.8 * divergence_from_start(free.params)
