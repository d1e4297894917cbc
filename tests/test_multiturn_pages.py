"""Multi-turn rows on the paged engine's pool (and, where it applies, the contiguous one): an extension the pool
cannot hold is refused and the row resumes to the same episode; an episode that ends while parked gives its
pages back."""

import concurrent.futures
import dataclasses

import jax
import numpy as np
import pytest

from streamrl_jax.envs import ToolResult
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.sampling import make_engine
from streamrl_jax.sampling.streaming_sampler import StreamingSampler
from streamrl_jax.types import SamplingParams
from tests.tool_rows import (MODEL, TOKENIZER, FixedTools, HeldTools, engine_and_params,  # noqa: F401
                             run_episode, steps_until)


def _paged(engine, **changes):
  return make_engine(engine.graphdef, MODEL, dataclasses.replace(engine.config, **changes), single_device_mesh())


def test_a_paged_pool_refuses_an_extension_it_cannot_hold_and_takes_it_once_pages_are_back(engine_and_params):
  engine, params = engine_and_params
  if engine.config.kv_layout != "paged":
    pytest.skip("the contiguous layout holds every slot's whole cache: it never refuses")
  small = _paged(engine, num_slots=2, kv_pages=8, prefix_cache_rows=0)  # 64 tokens: one full row
  placed, state = small.place_params(params), small.init_decode_state()
  knobs = [SamplingParams(max_new_tokens=32)] * 2
  prefix = small.prefill(placed, [list(range(3, 13)), list(range(3, 43))], samplings=knobs,
                         rngs=np.zeros((2, 2), np.uint32))
  state = small.insert(prefix, state, [0, 1])  # rows of 10 and 40 tokens: 2 + 5 pages
  state, refused = small.extend_room(state, {0: 20})  # 30 tokens need 4 pages; 1 is free
  assert refused == [0] and small.free_pages(state) == 1
  state = small.release(state, 1)
  state, refused = small.extend_room(state, {0: 20})
  assert refused == [] and small.free_pages(state) == 8 - 4
  state, firsts = small.extend(placed, state, [0], [list(range(3, 23))])
  assert np.asarray(state.pages.length)[0] == 30 and np.asarray(jax.device_get(state.rows.length))[0] == 30


class _RefusingOnce:
  """An engine whose first `extend_room` of some rows refuses them all (an injected full pool)."""

  def __init__(self, engine):
    self._engine, self.refusals = engine, 0

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def extend_room(self, state, rows):
    if self.refusals or not rows:
      return self._engine.extend_room(state, rows)
    self.refusals += 1
    return state, sorted(rows)


def test_a_row_refused_room_for_its_tool_tokens_resumes_to_the_same_episode(engine_and_params):
  engine, params = engine_and_params
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=24, stop_token_ids=(TOKENIZER.eos_id,))
  tokens = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
  whole = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy, FixedTools(tokens[j], [5, 6]))[0]
  refusing = _RefusingOnce(engine)
  resumed, sampler = run_episode(refusing, params, TOKENIZER.encode("12*34="), greedy, FixedTools(tokens[j], [5, 6]))
  assert refusing.refusals == 1 and sampler.counters["preempted"] == 1
  assert resumed.completion_tokens.tolist() == whole.completion_tokens.tolist()
  assert resumed.loss_mask.tolist() == whole.loss_mask.tolist()
  np.testing.assert_allclose(resumed.logprobs, whole.logprobs, atol=1e-5)


class _HeldEnding(HeldTools):
  """Held tools whose first call ends the episode."""

  def submit(self, state, turn):
    self.calls.append(list(turn))
    future = concurrent.futures.Future()
    self.pending.append((future, ToolResult(state + 1, (), 0.0, True)))
    return future


def test_an_episode_ending_while_parked_gives_its_memory_back(engine_and_params):
  """One slot: row a is parked on its call while b runs; the call then ends a's episode while a is still parked.
  Every page goes back to the pool (a paged row's pages are held while it is parked)."""
  engine, params = engine_and_params
  one = _paged(engine, num_slots=1, kv_pages=16)
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=20, stop_token_ids=(TOKENIZER.eos_id,))
  a = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  b = run_episode(engine, params, TOKENIZER.encode("5*6="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(a)) if a[i] not in a[:i] and a[i] not in b)
  tools = _HeldEnding(a[j], [])
  sampler = StreamingSampler([one], params, tools=tools)
  sampler.submit(TOKENIZER.encode("12*34="), SamplingParams(**greedy), group_id=0)
  sampler.submit(TOKENIZER.encode("5*6="), SamplingParams(**greedy), group_id=1)
  finished = steps_until(sampler, [], lambda done: done)
  assert sampler.counters["parked"] == 1 and [s.group_id for s in finished] == [1]
  tools.release()
  finished = steps_until(sampler, finished, lambda done: not sampler.has_work())
  assert [s.group_id for s in finished] == [1, 0] and finished[1].finish_reason == "turns"
  if one.config.kv_layout == "paged":
    state = one.drop_prefix_cache(sampler._instances[0].state)
    assert one.free_pages(state) == one.num_pages
