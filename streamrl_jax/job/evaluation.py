"""The run's held-out evaluation, one for every path (before RL, every `JobConfig.eval_every` steps, after RL, each
arm's end, a follower program's): greedy accuracy on prompts drawn with their own seed, never trained on."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from flax import nnx

from streamrl_jax.agents.evaluation import agent_completions
from streamrl_jax.envs import make_tools
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.records.run_files import write_eval_rows
from streamrl_jax.rewards import RewardScorer
from streamrl_jax.models import ModelConfig
from streamrl_jax.sampling import EngineConfig, SamplerConfig, StreamingSampler, make_engine
from streamrl_jax.tasks import prompt_tokens, question, verifier
from streamrl_jax.tasks.heldout import accuracy, evaluation_where, heldout_prompts
from streamrl_jax.types import SamplingParams


@dataclasses.dataclass(frozen=True)
class HeldOut:
  """Greedy accuracy on `prompts` prompts of the held-out `task` drawn with `seed`, scored by the run's rewards: the
  policy decoded with `sampler`'s engine and `max_new_tokens`, or, for an agent task, served to one episode of the
  agent program per prompt. Every policy of a run (the lead's, an arm's) is evaluated by the same one."""

  tokenizer: object
  task: object
  sampler: SamplerConfig
  max_new_tokens: int
  prompts: int
  seed: int

  def rows(self, model) -> list[tuple[str, str, float]]:
    """(prompt, completion text, reward) of each held-out prompt."""
    if self.sampler.env.agent:
      return agent_completions(model, self.tokenizer, self.task, self.sampler, self.max_new_tokens, self.prompts,
                               self.seed)
    return greedy_completions(model, self.tokenizer, self.task, self.sampler, self.max_new_tokens, self.prompts,
                              self.seed)

  def accuracy(self, model, record: Path | None = None) -> float:
    """The share of held-out prompts answered correctly; with `record`, every row is written there (JSON lines)."""
    rows = self.rows(model)
    if record is not None:
      write_eval_rows(record, rows)
    return accuracy([r for _, _, r in rows])


@functools.lru_cache(maxsize=4)
def _engine(graphdef, model_config: ModelConfig, config: EngineConfig):
  """One engine per model and engine config, kept: an evaluation after the first (every `JobConfig.eval_every` steps,
  after RL, each arm's) runs the programs the first traced, rather than tracing and lowering a new engine's anew."""
  return make_engine(graphdef, model_config, config, single_device_mesh())


def greedy_completions(model, tokenizer, task, sampler: SamplerConfig, max_new_tokens: int, prompts: int,
                       seed: int) -> list[tuple[str, str, float]]:
  """(prompt, completion text, reward) of greedy decoding on `prompts` prompts drawn with their own seed, with
  `sampler`'s engine and tools, scored by its rewards."""
  graphdef, params = nnx.split(model)
  engine = _engine(graphdef, model.config, sampler.engine)
  tools = make_tools(sampler.env, tokenizer)
  streaming = StreamingSampler([engine], params, tools=tools)
  items = heldout_prompts(task, prompts, seed)
  knobs = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tokenizer.stop_ids)
  ids = {streaming.submit(prompt_tokens(task, tokenizer, p), knobs)[0]: (p, row) for p, row in items}
  out = {}
  with RewardScorer(sampler.reward, builtin=verifier(task)) as scorer:
    for sample in streaming.stream():
      (prompt, row), text = ids[sample.request_id], tokenizer.decode(sample.completion_tokens)
      scorer.submit(sample.request_id, question(task, prompt), text, row.fields, evaluation_where(prompt, row))
      out[sample.request_id] = (prompt, text, sample.env_reward)
    while scorer.pending:
      scorer.wait(1.0)
      for request_id, score in scorer.done():
        prompt, text, env_reward = out[request_id]
        out[request_id] = (prompt, text, score.total + env_reward)
  if tools is not None:
    tools.close()
  return [out[i] for i in sorted(out)]
