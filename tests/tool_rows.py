"""Multi-turn rows at the driver, shared by the multi-turn tests: a tiny model, an engine of each KV layout, tools
whose stop token and answer a test chooses (answered at once, or held until the test releases them), and
helpers that run one episode or step a sampler until a condition holds."""

from __future__ import annotations

import concurrent.futures

import pytest
from flax import nnx

from streamrl_jax.envs import ToolResult
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer
from streamrl_jax.sampling import EngineConfig, make_engine
from streamrl_jax.sampling.streaming_sampler import StreamingSampler
from streamrl_jax.types import SamplingParams

TOKENIZER = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, eos_token_id=TOKENIZER.eos_id)


# Both KV layouts run multi-turn rows: the paged one with pages of 8 tokens (a 64-token row is 8 pages).
LAYOUTS = {"contiguous": {}, "paged": dict(kv_layout="paged", page_size=8)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def engine_and_params(request):
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(3)))
  config = EngineConfig(num_slots=4, max_prompt_length=32, max_new_tokens=32, **LAYOUTS[request.param])
  return make_engine(graphdef, MODEL, config, single_device_mesh()), params


class FixedTools:
  """Tools whose stop token and observation the test chooses; a second call ends the episode."""

  def __init__(self, stop_id: int, observation: list[int]):
    self.stop_ids, self.observation, self.calls = (stop_id,), observation, []

  def start(self, prompt, seed):
    return 0

  def submit(self, state, turn):
    self.calls.append(list(turn))
    future = concurrent.futures.Future()
    future.set_result(ToolResult(state + 1, () if state else tuple(self.observation), 0.0, bool(state)))
    return future


def run_episode(engine, params, prompt, params_kw, tools=None, seed=0):
  sampler = StreamingSampler([engine], params, tools=tools, seed=seed)
  sampler.submit(prompt, SamplingParams(**params_kw), group_id=7)
  return list(sampler.stream())[0], sampler


class HeldTools(FixedTools):
  """Tools whose first call returns only when the test releases it."""

  def __init__(self, stop_id: int, observation: list[int]):
    super().__init__(stop_id, observation)
    self.pending: list[concurrent.futures.Future] = []

  def submit(self, state, turn):
    self.calls.append(list(turn))
    future = concurrent.futures.Future()
    self.pending.append((future, ToolResult(state + 1, () if state else tuple(self.observation), 0.0, bool(state))))
    return future

  def release(self) -> None:
    for future, result in self.pending:
      future.set_result(result)
    self.pending = []


def steps_until(sampler, finished: list, condition, most: int = 200) -> list:
  """Steps the sampler (at most `most` times) until `condition(finished so far)`; returns the finished samples."""
  for _ in range(most):
    finished = finished + sampler.step()
    if condition(finished):
      return finished
  raise AssertionError(f"not done after {most} steps: {len(finished)} finished")
