"""The decode engine and continuous-batching driver against full forwards, transformers and properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrl_jax.meshes import MeshShape, mesh_from_devices, split_mesh
from streamrl_jax.models import load_hf
from streamrl_jax.sampling import DecodeEngine, EngineConfig, StreamingSampler, measure_ptl_curve
from streamrl_jax.types import SamplingParams

ENGINE = EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=60, min_prefill_bucket=8)  # windows 64, 76
PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4, 60, 61, 62, 70, 3, 11], [7, 90, 12]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def setup(hf_dirs):
  """(engine on 2 devices, params, hf model) shared by the module: one set of compiles."""
  directory, hf_model = hf_dirs["qwen2"]
  model = load_hf(directory)
  graphdef, params = nnx.split(model)
  mesh = mesh_from_devices(jax.devices()[:2], MeshShape(2, 1, 1))
  return DecodeEngine(graphdef, model.config, ENGINE, mesh), params, model, hf_model


def run_all(sampler):
  return {s.request_id: s for s in sampler.stream()}


def test_greedy_matches_argmax_loop_and_transformers(setup):
  engine, params, model, hf_model = setup
  sampler = StreamingSampler([engine], params)
  ids = [sampler.submit(p, GREEDY)[0] for p in PROMPTS]
  samples = run_all(sampler)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))  # causal: right padding changes nothing before it
  for request_id, prompt in zip(ids, PROMPTS):
    tokens = np.zeros((1, len(prompt) + 32), np.int32)
    tokens[0, :len(prompt)] = prompt
    for n in range(len(prompt), len(prompt) + 32):  # the plain loop: full forward, argmax, append
      tokens[0, n] = int(jnp.argmax(forward(state, tokens)[0, n - 1]))
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    got = samples[request_id].completion_tokens
    np.testing.assert_array_equal(got, tokens[0, len(prompt):])
    np.testing.assert_array_equal(got, ref[0, len(prompt):].numpy())
    assert samples[request_id].finish_reason == "length"


def test_logprobs_equal_full_forward_log_softmax(setup):
  engine, params, model, _ = setup
  sampler = StreamingSampler([engine], params, seed=3)
  for prompt, n in zip(PROMPTS, (20, 60, 8)):  # the 60-token one crosses from window 64 to 76
    sampler.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=n))
  samples = run_all(sampler)
  assert max(s.num_tokens for s in samples.values()) == 60
  for sample in samples.values():
    full = np.concatenate([sample.prompt_tokens, sample.completion_tokens])
    logp = jax.nn.log_softmax(model(jnp.asarray(full[None, :-1]))[0])
    n = len(sample.prompt_tokens)
    expected = np.asarray(logp[n - 1:, :])[np.arange(len(sample.completion_tokens)), sample.completion_tokens]
    np.testing.assert_allclose(sample.logprobs, expected, atol=1e-5)


def test_short_request_admitted_after_long_one_finishes_first(setup):
  engine, params, _, _ = setup
  sampler = StreamingSampler([engine], params)
  long_id = sampler.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=40))[0]
  sampler.step()
  sampler.step()
  short_id = sampler.submit(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=3))[0]
  order = [s.request_id for s in sampler.stream()]
  assert order == [short_id, long_id]


def test_sampling_is_reproducible_whatever_the_slot(setup):
  engine, params, _, _ = setup
  knobs = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=12, num_samples=2)
  alone = StreamingSampler([engine], params, seed=7)
  alone.submit(PROMPTS[2], knobs, group_id=42)
  crowded = StreamingSampler([engine], params, seed=7)
  crowded.submit(PROMPTS[0], SamplingParams(max_new_tokens=5, num_samples=3), group_id=1)  # occupy slots 0-2
  crowded.submit(PROMPTS[2], knobs, group_id=42)
  a = {(s.group_id, s.sample_index): s.completion_tokens for s in alone.stream()}
  b = {(s.group_id, s.sample_index): s.completion_tokens for s in crowded.stream()}
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(a[(42, 0)], a[(42, 1)])  # the two group members differ


def test_weight_swap_mid_generation_changes_tokens_and_is_recorded(setup):
  engine, params, _, _ = setup
  reference = StreamingSampler([engine], params)
  reference.submit(PROMPTS[0], GREEDY)
  unchanged = next(reference.stream())
  swapped = StreamingSampler([engine], params)
  swapped.submit(PROMPTS[0], GREEDY)
  for _ in range(5):
    assert not swapped.step()
  scaled = jax.tree.map(lambda x: x * 1.5, params)
  swapped.update_params(scaled, version=1)
  sample = next(swapped.stream())
  assert (sample.first_version, sample.last_version) == (0, 1)
  np.testing.assert_array_equal(sample.completion_tokens[:6], unchanged.completion_tokens[:6])
  assert not np.array_equal(sample.completion_tokens[6:], unchanged.completion_tokens[6:])


def test_stop_tokens_end_a_request(setup):
  engine, params, _, _ = setup
  sampler = StreamingSampler([engine], params)
  sampler.submit(PROMPTS[0], GREEDY)
  free_run = next(sampler.stream()).completion_tokens
  stop = int(free_run[4])
  sampler.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=(stop,)))
  sample = next(sampler.stream())
  first = list(free_run).index(stop)
  np.testing.assert_array_equal(sample.completion_tokens, free_run[:first + 1])
  assert sample.finish_reason == "stop"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 16), st.integers(1, 60), st.integers(0, 3), st.integers(1, 3)),
                min_size=1, max_size=12))
def test_no_request_lost_or_duplicated(setup, arrivals):
  engine, params, _, _ = setup
  sampler = StreamingSampler([engine], params)
  expected, seen = {}, []
  for prompt_len, max_new, steps_before, n in arrivals:
    for _ in range(steps_before):
      seen += sampler.step()
    knobs = SamplingParams(temperature=1.0, max_new_tokens=max_new, num_samples=n)
    for request_id in sampler.submit(list(range(1, prompt_len + 1)), knobs):
      expected[request_id] = max_new
  seen += list(sampler.stream())
  assert sorted(s.request_id for s in seen) == sorted(expected)
  for s in seen:
    assert 1 <= s.num_tokens <= expected[s.request_id]
    assert s.finish_reason == "length" and s.num_tokens == expected[s.request_id]


def test_several_instances_return_every_request_once(setup, hf_dirs):
  engine, params, model, _ = setup
  graphdef, _ = nnx.split(model)
  sampler_mesh = mesh_from_devices(jax.devices()[2:8], MeshShape(6, 1, 1))
  meshes = split_mesh(sampler_mesh, [4, 2])
  engines = [DecodeEngine(graphdef, model.config, EngineConfig(num_slots=s, max_prompt_length=16,
                                                               max_new_tokens=60, min_prefill_bucket=8), m)
             for s, m in zip([4, 2], meshes)]
  sampler = StreamingSampler(engines, params)
  ids = []
  for i in range(10):
    ids += sampler.submit(PROMPTS[i % 3], SamplingParams(temperature=0.0, max_new_tokens=5 + 3 * i),
                          instance=i % 2 if i < 4 else None)
  samples = list(sampler.stream())
  assert sorted(s.request_id for s in samples) == sorted(ids)
  assert {s.instance for s in samples} == {0, 1}
  single = StreamingSampler([engine], params)
  single.submit(PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=29))
  by_id = {s.request_id: s for s in samples}
  np.testing.assert_array_equal(by_id[ids[8]].completion_tokens, next(single.stream()).completion_tokens)


def test_bad_input_gets_clear_errors(setup):
  engine, params, _, _ = setup
  sampler = StreamingSampler([engine], params)
  with pytest.raises(ValueError, match="empty prompt"):
    sampler.submit([], GREEDY)
  with pytest.raises(ValueError, match="17 tokens exceeds EngineConfig.max_prompt_length=16"):
    sampler.submit(list(range(17)), GREEDY)
  with pytest.raises(ValueError, match="max_new_tokens=61 exceeds"):
    sampler.submit([1], SamplingParams(max_new_tokens=61))
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    SamplingParams(temperature=-0.1)
  for bad in (0.0, 1.5):
    with pytest.raises(ValueError, match="top_p must be in"):
      SamplingParams(top_p=bad)
  assert not sampler.has_work()


def test_engine_refuses_configs_beyond_memory_budget(setup):
  engine, params, model, _ = setup
  graphdef, _ = nnx.split(model)
  too_big = EngineConfig(num_slots=64, max_prompt_length=16, max_new_tokens=60, memory_budget_bytes=200_000)
  with pytest.raises(ValueError, match="lower num_slots"):
    DecodeEngine(graphdef, model.config, too_big, engine.mesh)
  per_slot = engine.memory["kv_bytes_per_slot"]
  assert per_slot == 2 * 2 * 76 * 2 * 16 * 4  # k+v, layers, cache length, kv heads, head_dim, float32


def test_admission_policy_orders_the_queue(setup):
  from streamrl_jax.scheduling import longest_first_admission
  engine, params, _, _ = setup
  sampler = StreamingSampler([engine], params, admission=longest_first_admission)
  predicted = [5.0, 50.0, 20.0, 1.0, 40.0, 30.0]
  ids = [sampler.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=4), predicted_length=p)[0]
         for p in predicted]
  samples = {s.request_id: s for s in sampler.stream()}
  first_wave = min(s.admit_time for s in samples.values())
  admitted_first = {i for i, rid in enumerate(ids) if samples[rid].admit_time == first_wave}
  assert admitted_first == {1, 2, 4, 5}  # the four longest predictions take the four slots


def test_slot_limit_caps_busy_slots(setup):
  engine, params, _, _ = setup
  sampler = StreamingSampler([engine], params)
  sampler.set_slot_limits({0: 2})
  ids = [sampler.submit(PROMPTS[i % 3], SamplingParams(temperature=0.0, max_new_tokens=6))[0] for i in range(5)]
  seen, busiest = [], 0
  while sampler.has_work():
    seen += sampler.step()
    busiest = max(busiest, sampler.num_in_flight)
  assert busiest == 2 and sorted(s.request_id for s in seen) == ids
  with pytest.raises(ValueError, match="slot limit of instance 0 must be >= 0"):
    sampler.set_slot_limits({0: -1})
  with pytest.raises(ValueError, match="no engine instance 7"):
    sampler.set_slot_limits({7: 1})


def test_instances_join_and_retire_mid_stream_without_losing_samples(setup):
  """An engine instance added while requests are in flight takes new ones; a retired one finishes its in-flight
  requests, hands its queue over, and leaves. Every sample equals the single-instance run."""
  engine, params, model, _ = setup
  graphdef, _ = nnx.split(model)
  other = DecodeEngine(graphdef, model.config, ENGINE, mesh_from_devices(jax.devices()[2:4], MeshShape(2, 1, 1)))
  knobs = [SamplingParams(temperature=1.0, max_new_tokens=4 + 5 * (i % 4)) for i in range(12)]
  reference = StreamingSampler([engine], params, seed=7)
  for wave in (0, 100):
    for i, k in enumerate(knobs):
      reference.submit(PROMPTS[i % 3], k, group_id=wave + i)
  expected = {s.group_id: s.completion_tokens for s in reference.stream()}

  sampler = StreamingSampler([engine], params, seed=7)
  for i, k in enumerate(knobs):
    sampler.submit(PROMPTS[i % 3], k, group_id=i)
  samples = sampler.step()
  added = sampler.add_instance(other)
  assert sampler.instance_ids == [0, added]
  for i, k in enumerate(knobs):  # a second wave, spread over both instances by load
    sampler.submit(PROMPTS[i % 3], k, group_id=100 + i)
  samples += sampler.step()
  assert sampler.num_in_flight > 0
  sampler.retire_instance(0)  # in flight on 0: they finish there; its queue moves to `added`
  assert sampler.instance_ids == [added]
  with pytest.raises(ValueError, match="cannot retire the last"):
    sampler.retire_instance(added)
  samples += list(sampler.stream())
  got = {s.group_id: s for s in samples}
  assert len(samples) == len(got) == 24
  assert {s.instance for s in samples} == {0, added}
  for group, tokens in expected.items():
    np.testing.assert_array_equal(got[group].completion_tokens, tokens)


def test_an_idle_instance_swaps_to_an_engine_with_fewer_slots(setup):
  engine, params, model, _ = setup
  graphdef, _ = nnx.split(model)
  small = DecodeEngine(graphdef, model.config, EngineConfig(num_slots=2, max_prompt_length=16, max_new_tokens=60,
                                                            min_prefill_bucket=8), engine.mesh)
  knobs = SamplingParams(temperature=1.0, max_new_tokens=9)
  reference = StreamingSampler([engine], params, seed=5)
  for i in range(3):
    reference.submit(PROMPTS[i], knobs, group_id=i)
  expected = {s.group_id: s.completion_tokens for s in reference.stream()}
  sampler = StreamingSampler([engine], params, seed=5)
  sampler.submit(PROMPTS[0], knobs, group_id=0)
  with pytest.raises(ValueError, match="instance 0 is busy"):
    sampler.replace_engine(0, small)
  first = list(sampler.stream())
  sampler.replace_engine(0, small)
  for i in (1, 2):
    sampler.submit(PROMPTS[i], knobs, group_id=i)
  sampler.step()
  assert sampler.num_in_flight == 2  # the small engine's two slots
  samples = first + list(sampler.stream())
  for s in samples:
    np.testing.assert_array_equal(s.completion_tokens, expected[s.group_id])


def test_measure_ptl_curve_times_a_full_engine(setup):
  engine, params, _, _ = setup
  curve = measure_ptl_curve(lambda slots: engine, params, (ENGINE.num_slots,), steps=3)
  assert list(curve) == [ENGINE.num_slots] and curve[ENGINE.num_slots] > 0
  with pytest.raises(ValueError, match="too short to time 80 decode steps"):
    measure_ptl_curve(lambda slots: engine, params, (4,), steps=80)


def test_a_batched_prefill_equals_prefills_one_at_a_time(setup):
  engine, params, _, _ = setup
  placed = engine.place_params(params)
  knobs = [SamplingParams(temperature=1.0, max_new_tokens=8)] * 3
  rngs = np.asarray([[1, 2], [3, 4], [5, 6]], np.uint32)
  batch = engine.prefill(placed, PROMPTS, samplings=knobs, rngs=rngs)  # 3 rows padded to 4, lengths to 16
  assert batch.valid.shape == (4, 16)
  for i, prompt in enumerate(PROMPTS):
    one = engine.prefill(placed, [prompt], samplings=knobs[:1], rngs=rngs[i:i + 1])
    assert int(one.first_token[0]) == int(batch.first_token[i])
    np.testing.assert_allclose(one.first_logprob[0], batch.first_logprob[i], atol=1e-5)
    for k_one, k_batch in zip(one.keys, batch.keys):
      np.testing.assert_allclose(k_one[0, :, :len(prompt)], k_batch[i, :, :len(prompt)], atol=1e-5)
  with pytest.raises(ValueError, match="distinct slots"):
    engine.insert(batch, engine.init_decode_state(), [0, 0])


def test_a_groups_prompt_is_prefilled_once_and_each_request_samples_its_own_first_token(setup, monkeypatch):
  engine, params, _, _ = setup
  placed = engine.place_params(params)
  knobs = [SamplingParams(temperature=1.0, max_new_tokens=8)] * 4
  rngs = np.asarray([[1, 2], [3, 4], [5, 6], [7, 8]], np.uint32)
  prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0]]
  prefill, passes = engine._prefill, []
  monkeypatch.setattr(engine, "_prefill", lambda p, tokens, lengths: passes.append(tokens.copy()) or prefill(
      p, tokens, lengths))
  shared = engine.prefill(placed, prompts, samplings=knobs, rngs=rngs)
  assert len(passes) == 1 and passes[0].shape[0] == 2  # two distinct prompts: one pass over each
  np.testing.assert_array_equal(passes[0][0, :len(PROMPTS[0])], PROMPTS[0])
  one_at_a_time = [engine.prefill(placed, [p], samplings=knobs[:1], rngs=rngs[i:i + 1]) for i, p in enumerate(prompts)]
  for i, (prompt, one) in enumerate(zip(prompts, one_at_a_time)):
    assert int(one.first_token[0]) == int(shared.first_token[i]) and int(shared.true_length[i]) == len(prompt)
    np.testing.assert_allclose(one.first_logprob[0], shared.first_logprob[i], atol=1e-5)
    for k_one, k_shared in zip(one.keys, shared.keys):
      np.testing.assert_allclose(k_one[0, :, :len(prompt)], k_shared[i, :, :len(prompt)], atol=1e-5)
  resumed = engine.prefill(placed, prompts[:2], samplings=knobs[:2], rngs=rngs[:2], resume=[(5, 3), None])
  assert passes[-1].shape[0] == 2 and int(resumed.first_token[0]) == 5  # a resumed request is never shared
  with pytest.raises(ValueError, match="must be a power of two"):
    EngineConfig(prefill_batch=6)


def test_compiles_stay_within_the_stated_bound(setup):
  """Run last in this module: everything above compiled at most the bound the engine states."""
  engine, _, _, _ = setup
  rows, lengths = len(ENGINE.row_buckets), len(ENGINE.prefill_buckets)
  assert engine._prefill._cache_size() <= rows * lengths and engine._insert._cache_size() <= rows * lengths
  assert engine._expand._cache_size() <= lengths * rows * (rows + 1) // 2
  assert engine._generate._cache_size() <= len(ENGINE.attention_windows) * len(ENGINE.step_options)
