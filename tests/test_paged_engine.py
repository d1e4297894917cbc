"""The paged engine against the contiguous one: the same greedy tokens with shared prompts, rows of very
different lengths and preemptions mid-sample; every page back in the pool after a run; bad configs refused."""

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.sampling import EngineConfig, StreamingSampler
from streamrl_jax.sampling.engines import make_engine
from streamrl_jax.types import SamplingParams

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
CONTIGUOUS = EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=48, min_prefill_bucket=16,
                          prefill_batch=4, steps_per_sync=2)
PAGED = EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=48, min_prefill_bucket=16, prefill_batch=4,
                     steps_per_sync=2, kv_layout="paged", page_size=8)
# (prompt, completion length): prompts of one group repeated, lengths from 1 to the maximum
REQUESTS = [([5, 9, 11, 3, 7, 2, 8, 13, 21, 4, 6], 40), ([5, 9, 11, 3, 7, 2, 8, 13, 21, 4, 6], 3),
            ([17, 2, 30], 48), ([17, 2, 30], 1), ([40, 41, 42, 43, 44, 45, 46, 47, 48], 20), ([9] * 16, 33),
            ([33, 34], 7), ([5, 9, 11, 3, 7, 2, 8, 13, 21, 4, 6], 12)]


@pytest.fixture(scope="module")
def model_parts():
  model = Transformer(MODEL, rngs=nnx.Rngs(3))
  graphdef, params = nnx.split(model)
  return graphdef, params, mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))


@pytest.fixture(scope="module")
def contiguous_samples(model_parts):
  graphdef, params, mesh = model_parts
  return generate_all(make_engine(graphdef, MODEL, CONTIGUOUS, mesh), params)[0]


def generate_all(engine, params, requests=REQUESTS):
  """Greedy completions by request id, and the sampler. Equal prompts admitted in one call share pages."""
  sampler = StreamingSampler([engine], params)
  ids = []
  for i, (prompt, length) in enumerate(requests):
    ids += sampler.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=length), group_id=i)
  out = {s.request_id: s for s in sampler.stream()}
  assert sorted(out) == ids  # every request finished once
  return out, sampler


def assert_same_samples(paged: dict, contiguous: dict) -> None:
  for rid, sample in contiguous.items():
    np.testing.assert_array_equal(paged[rid].completion_tokens, sample.completion_tokens, err_msg=f"request {rid}")
    np.testing.assert_allclose(paged[rid].logprobs, sample.logprobs, atol=2e-4, err_msg=f"request {rid}")


def pool_is_empty(sampler) -> bool:
  """No slot holds a page; reference counts are exactly the prefix cache's holdings, and zero once it is
  dropped (a leaked page fails)."""
  inst = sampler._instances[0]
  state, slots = inst.state, inst.engine.config.num_slots
  table, refcount = np.asarray(state.pages.table), np.asarray(state.pages.refcount)
  held = np.bincount(table[table >= 0], minlength=refcount.shape[0])
  if (table[:slots] != -1).any() or np.asarray(state.pages.length)[:slots].any() or (held != refcount).any():
    return False
  state = inst.engine.drop_prefix_cache(state)
  return not np.asarray(state.pages.refcount).any() and (np.asarray(state.pages.table) == -1).all()


def test_paged_greedy_equals_contiguous_with_shared_prompts_and_mixed_lengths(model_parts, contiguous_samples):
  graphdef, params, mesh = model_parts
  contiguous = contiguous_samples
  engine = make_engine(graphdef, MODEL, PAGED, mesh)
  paged, sampler = generate_all(engine, params)
  assert_same_samples(paged, contiguous)
  assert [len(paged[r].completion_tokens) for r in sorted(paged)] == [n for _, n in REQUESTS]
  assert engine.counters["preempted"] == 0 and pool_is_empty(sampler)


def test_a_group_prompt_is_prefilled_once_and_its_pages_shared(model_parts):
  graphdef, params, mesh = model_parts
  prompt = list(range(3, 14))  # 11 tokens: one full page of 8 shared, the partly filled second one copied
  group = [(prompt, 6)] * 4
  engine = make_engine(graphdef, MODEL, PAGED, mesh)
  sampler = StreamingSampler([engine], params)
  sampler.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=6, num_samples=4), group_id=7)
  sampler.step()  # admits the group in one prefill call and decodes
  state = sampler._instances[0].state
  tables, refcount = np.asarray(state.pages.table), np.asarray(state.pages.refcount)
  assert engine.counters["prefill_tokens"] == len(prompt) and engine.counters["prompts_shared"] == 3
  assert len({tables[s, 0] for s in range(4)}) == 1 and refcount[tables[0, 0]] == 5  # the full page: once, held
  assert len({tables[s, 1] for s in range(4)}) == 4  # by the 4 rows and the prefix cache; the partial: a copy each
  samples = {s.sample_index: s for s in sampler.stream()}
  contiguous = StreamingSampler([make_engine(graphdef, MODEL, CONTIGUOUS, mesh)], params)
  contiguous.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=6, num_samples=4), group_id=7)
  for s in contiguous.stream():  # the same keys: the same samples as four separate prefills
    np.testing.assert_array_equal(samples[s.sample_index].completion_tokens, s.completion_tokens)
  assert pool_is_empty(sampler) and len(group) == 4


def test_rows_preempted_when_pages_run_out_resume_as_one_continuous_generation(model_parts, contiguous_samples):
  graphdef, params, mesh = model_parts
  contiguous = contiguous_samples
  tight = EngineConfig(**{**PAGED.__dict__, "kv_pages": 12})  # 96 tokens for 4 rows of up to 64
  engine = make_engine(graphdef, MODEL, tight, mesh)
  paged, sampler = generate_all(engine, params)
  assert engine.counters["preempted"] > 0 and sampler.counters["preempted"] == engine.counters["preempted"]
  assert_same_samples(paged, contiguous)
  assert pool_is_empty(sampler)


def test_a_row_near_the_end_of_its_cache_is_not_preempted_after_a_shorter_call(model_parts):
  """A call of one step (the policy's, for rows just admitted) shifts where rows stand against `steps_per_sync`:
  a full-length row then asks for room past its cache's end, which a pool of free pages must still give it."""
  graphdef, params, mesh = model_parts
  four = {"steps_per_sync": 4, "num_slots": 2}
  full = [([9] * 16, 48), ([17, 2, 30], 48)]  # prompt + completion: the whole cache (64) and nearly
  paged = make_engine(graphdef, MODEL, EngineConfig(**{**PAGED.__dict__, **four}), mesh)
  samples, sampler = generate_all(paged, params, full)
  assert sampler.counters["preempted"] == 0 and pool_is_empty(sampler)
  contiguous = generate_all(make_engine(graphdef, MODEL, EngineConfig(**{**CONTIGUOUS.__dict__, **four}), mesh),
                            params, full)[0]
  assert_same_samples(samples, contiguous)


def test_bad_paged_configs_are_refused_naming_the_key(model_parts):
  graphdef, _, mesh = model_parts
  with pytest.raises(ValueError, match=r"EngineConfig.page_size=12 does not divide the attention windows \[64\]"):
    EngineConfig(**{**PAGED.__dict__, "page_size": 12})
  with pytest.raises(ValueError, match=r"EngineConfig.kv_pages=4 holds 32 tokens, fewer than one row"):
    make_engine(graphdef, MODEL, EngineConfig(**{**PAGED.__dict__, "kv_pages": 4}), mesh)
  with pytest.raises(ValueError, match=r"EngineConfig.kv_layout='ring'; known: \['contiguous', 'paged'\]"):
    EngineConfig(kv_layout="ring")
  with pytest.raises(ValueError, match=r"EngineConfig.attention='paged' is the paged cache's kernel: set "
                                       r"EngineConfig.kv_layout='paged'"):
    EngineConfig(kv_layout="contiguous", attention="paged")


def test_the_prefix_cache_serves_a_group_across_calls_but_never_across_weight_versions(model_parts):
  graphdef, params, mesh = model_parts
  prompt = list(range(3, 14))
  engine = make_engine(graphdef, MODEL, PAGED, mesh)
  sampler = StreamingSampler([engine], params)
  knobs = SamplingParams(temperature=1.0, max_new_tokens=5, num_samples=2)
  sampler.submit(prompt, knobs, group_id=1)
  first = {s.sample_index: s for s in sampler.stream()}
  sampler.submit(prompt, knobs, group_id=1, first_sample_index=2)  # the rest of the group, in a later call
  later = {s.sample_index: s for s in sampler.stream()}
  assert engine.counters["prefill_tokens"] == len(prompt) and engine.counters["prefix_cache_hits"] == 2
  contiguous = StreamingSampler([make_engine(graphdef, MODEL, CONTIGUOUS, mesh)], params)
  contiguous.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=5, num_samples=4), group_id=1)
  for s in contiguous.stream():  # the cached prompt gives the samples four separate prefills give
    np.testing.assert_array_equal({**first, **later}[s.sample_index].completion_tokens, s.completion_tokens)
  other = jax.tree.map(lambda x: x * 1.5, params)
  sampler.update_params(other, version=1)
  sampler.submit(prompt, knobs, group_id=2)
  list(sampler.stream())
  assert engine.counters["prefill_tokens"] == 2 * len(prompt)  # new weights: prefilled again
  assert engine.counters["prefix_cache_hits"] == 2
  assert [key[1] for key, _ in sampler._instances[0].state.cache] == [1]  # the old version's entry is gone
  assert pool_is_empty(sampler)


def test_the_decode_kernel_gives_the_gather_forms_greedy_tokens(model_parts):
  """`EngineConfig.attention='paged'`: every decode step's attention in the Pallas paged-attention kernel (interpret
  mode here), the same greedy tokens as XLA's gather; log-probabilities within the kernel's bfloat16 reads."""
  import dataclasses
  graphdef, params, mesh = model_parts
  requests = [([5, 9, 11, 3, 7, 2, 8, 13, 21, 4, 6], 6), ([17, 2, 30], 5)]
  want, _ = generate_all(make_engine(graphdef, MODEL, PAGED, mesh), params, requests)
  got, _ = generate_all(make_engine(graphdef, MODEL, dataclasses.replace(PAGED, attention="paged"), mesh), params,
                        requests)
  for rid, sample in want.items():
    np.testing.assert_array_equal(got[rid].completion_tokens, sample.completion_tokens)
    np.testing.assert_allclose(got[rid].logprobs, sample.logprobs, atol=2e-2)
