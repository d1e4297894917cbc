"""Weights updated in flight and partial rollouts, at the driver: each token's version and log-probability
against full forwards of that version's weights; a rollout resumed on another sampler against one never
interrupted."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import load_hf
from streamrl_jax.sampling import EngineConfig, StreamingSampler, make_engine
from streamrl_jax.types import Rollout, SamplingParams

ENGINE = EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=40, min_prefill_bucket=8)
PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4, 60, 61, 62, 70, 3, 11]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=30)


@pytest.fixture(scope="module")
def setup(hf_dirs, request):
  """The engine of a KV layout (`request.param`; contiguous unless a test asks for both): pages of 8 tokens, a
  56-token row is 7 pages."""
  directory, _ = hf_dirs["qwen2"]
  model = load_hf(directory)
  graphdef, params = nnx.split(model)
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  layout = getattr(request, "param", "contiguous")
  config = ENGINE if layout == "contiguous" else dataclasses.replace(ENGINE, kv_layout="paged", page_size=8)
  return make_engine(graphdef, model.config, config, mesh), graphdef, params


def token_logprobs(graphdef, params, sample) -> np.ndarray:
  """log pi(token) of each completion token under `params`, from one full forward."""
  full = np.concatenate([sample.prompt_tokens, sample.completion_tokens])
  logp = jax.nn.log_softmax(nnx.merge(graphdef, params)(jnp.asarray(full[None, :-1]))[0])
  n = len(sample.prompt_tokens)
  return np.asarray(logp[n - 1:])[np.arange(sample.num_tokens), sample.completion_tokens]


def run_with_update(engine, params, new_params, *, recompute: bool, sampling=SAMPLED, before: int = 6):
  sampler = StreamingSampler([engine], params, seed=4)
  for prompt in PROMPTS:
    sampler.submit(prompt, sampling)
  for _ in range(before):
    assert not sampler.step()
  sampler.update_params(new_params, version=1, recompute=recompute)
  return sampler, sorted(sampler.stream(), key=lambda s: s.request_id)


@pytest.mark.parametrize("setup", ["contiguous", "paged"], indirect=True)
def test_a_row_crossing_an_update_records_each_tokens_version_and_its_own_weights_logprob(setup):
  engine, graphdef, params = setup
  new = jax.tree.map(lambda x: x * 1.3, params)
  sampler, samples = run_with_update(engine, params, new, recompute=True)
  assert sampler.counters["recomputed"] == len(PROMPTS)
  for sample in samples:
    versions = sample.versions
    cut = int(np.argmax(versions == 1))
    assert cut == 7  # the prefill's token and 6 decode steps came from version 0
    np.testing.assert_array_equal(versions, [0] * cut + [1] * (sample.num_tokens - cut))
    assert (sample.first_version, sample.last_version) == (0, 1)
    # each token's log-probability is that of the weights that sampled it, given everything before it
    np.testing.assert_allclose(sample.logprobs[:cut], token_logprobs(graphdef, params, sample)[:cut], atol=2e-5)
    np.testing.assert_allclose(sample.logprobs[cut:], token_logprobs(graphdef, new, sample)[cut:], atol=2e-5)


@pytest.mark.parametrize("setup", ["contiguous", "paged"], indirect=True)
def test_kept_cache_continues_without_prefill_and_differs_from_recompute_after_the_update(setup):
  engine, graphdef, params = setup
  new = jax.tree.map(lambda x: x * 1.3, params)
  kept_sampler, kept = run_with_update(engine, params, new, recompute=False, sampling=GREEDY)
  _, recomputed = run_with_update(engine, params, new, recompute=True, sampling=GREEDY)
  assert kept_sampler.counters["recomputed"] == 0
  for a, b in zip(kept, recomputed):
    np.testing.assert_array_equal(a.versions, b.versions)
    np.testing.assert_array_equal(a.completion_tokens[:7], b.completion_tokens[:7])
    np.testing.assert_allclose(a.logprobs[:7], token_logprobs(graphdef, params, a)[:7], atol=2e-5)
    # the first token after the update attends over the old cache: not the new weights' own forward
    assert abs(a.logprobs[7] - token_logprobs(graphdef, new, a)[7]) > 1e-4


@pytest.mark.parametrize("setup, sampling", [("contiguous", GREEDY), ("contiguous", SAMPLED), ("paged", SAMPLED)],
                         ids=["greedy", "sampled", "paged-sampled"], indirect=["setup"])
def test_a_partial_rollout_resumed_elsewhere_equals_one_never_interrupted(setup, sampling):
  engine, _, params = setup
  reference = StreamingSampler([engine], params, seed=9)
  for g, prompt in enumerate(PROMPTS):
    reference.submit(prompt, sampling, group_id=g)
  whole = {s.group_id: s for s in reference.stream()}

  first = StreamingSampler([engine], params, seed=9)
  for g, prompt in enumerate(PROMPTS):
    first.submit(prompt, sampling, group_id=g)
  for _ in range(12):
    assert not first.step()
  handed = first.in_flight_progress()
  assert [len(p.completion_tokens) for _, p in handed] == [13, 13]
  second = StreamingSampler([engine], params, seed=9)  # another sampler: no state shared but the weights
  for request, progress in handed:
    second.submit(request.prompt_tokens, request.params, group_id=request.group_id, progress=progress)
  assert second.counters["resumed_partial"] == 2
  resumed = {s.group_id: s for s in second.stream()}
  for g in whole:
    np.testing.assert_array_equal(resumed[g].completion_tokens, whole[g].completion_tokens)
    np.testing.assert_allclose(resumed[g].logprobs, whole[g].logprobs, atol=2e-5)


def test_progress_that_cannot_resume_is_refused(setup):
  engine, _, params = setup
  sampler = StreamingSampler([engine], params)
  with pytest.raises(ValueError, match="one of each per token"):
    Rollout(0, 0, (1, 2), (0.0,), (0, 0))
  with pytest.raises(ValueError, match="finished already"):
    sampler.submit(PROMPTS[0], SamplingParams(max_new_tokens=2), progress=Rollout(0, 0, (1, 2), (-1.0, -1.0), (0, 0)))
  with pytest.raises(ValueError, match="one sample"):
    sampler.submit(PROMPTS[0], SamplingParams(num_samples=2), progress=Rollout(0, 0, (1,), (-1.0,), (0,)))
  with pytest.raises(ValueError, match="does not fit the cache"):
    ENGINE.resume_bucket_for(ENGINE.cache_length)


def test_the_off_policy_corrections_weigh_each_token_by_its_own_versions_probability(setup):
  """A row that crossed an update: each token's behaviour log-probability is its own version's, and the
  corrections (token_tis, token_tis with token_mask, aipo in bypass) use it token by token (numpy below), not one
  per sample."""
  from streamrl_jax.training import ObjectiveConfig
  from streamrl_jax.training.objectives import policy_loss
  engine, graphdef, params = setup
  new = jax.tree.map(lambda x: x * 1.3, params)
  _, samples = run_with_update(engine, params, new, recompute=True)
  sample = samples[0]
  mu = sample.logprobs[None]  # the sampler's: version 0 then version 1
  pi = token_logprobs(graphdef, new, sample)[None]  # the trainer's policy, version 1
  advantages = np.full_like(mu, 0.7)
  mask = np.ones_like(mu, bool)
  batch = dict(logprobs=jnp.asarray(mu), old_logprobs=jnp.asarray(pi), advantages=jnp.asarray(advantages),
               loss_mask=jnp.asarray(mask))
  from streamrl_jax.training.corrections import CorrectionConfig
  capped = CorrectionConfig(tis_cap=1.5, mask_low=0.0, mask_high=1.5)
  configs = {"token_tis": ObjectiveConfig(bands=capped),
             "token_tis_mask": ObjectiveConfig(bands=capped, correction=("token_tis", "token_mask")),
             "aipo": ObjectiveConfig(objective="aipo", aipo_rho=1.5, old_logprobs="sampler", correction="none")}
  ratio = np.exp(pi - mu)
  surrogate = -np.minimum(advantages, np.clip(1.0, 0.8, 1.2) * advantages)  # pi / pi_old = 1
  expected = {"token_tis": np.minimum(ratio, 1.5) * surrogate,
              "token_tis_mask": np.where(ratio <= 1.5, ratio, 0.0) * surrogate,
              "aipo": -np.minimum(ratio, 1.5) * advantages * pi}
  cut = int(np.argmax(sample.versions == 1))
  np.testing.assert_allclose(ratio[0, cut:], 1.0, atol=1e-4)  # the new version's tokens: on-policy
  assert np.abs(ratio[0, :cut] - 1.0).max() > 1e-3  # the old version's: corrected
  for name, want in expected.items():
    cfg = configs[name]
    given = batch if cfg.old_logprobs == "recompute" else {**batch, "old_logprobs": batch["logprobs"]}
    got = np.asarray(policy_loss(jnp.asarray(pi), given, cfg)[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
