"""The run's held-out evaluation, one for every path (before RL, every `JobConfig.eval_every` steps, after RL, each
arm's end, a follower program's): greedy accuracy on prompts drawn with their own seed, never trained on, and with
`JobConfig.eval_k`, avg@k and pass@k of k samples a prompt at a temperature (one prefill a prompt, its k samples
sharing it)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from flax import nnx

from streamrl_jax.agents.evaluation import agent_completions
from streamrl_jax.envs import make_tools
from streamrl_jax.job.config import JobConfig
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.records.run_files import write_eval_rows
from streamrl_jax.rewards import RewardScorer
from streamrl_jax.models import ModelConfig
from streamrl_jax.sampling import EngineConfig, SamplerConfig, StreamingSampler, make_engine
from streamrl_jax.tasks import prompt_tokens, question, verifier
from streamrl_jax.tasks.heldout import accuracy, at_k, evaluation_where, heldout_prompts
from streamrl_jax.types import SamplingParams


@dataclasses.dataclass(frozen=True)
class Sampled:
  """Evaluation at k (`JobConfig.eval_k`, `eval_temperature`, `eval_top_p`): k samples of each held-out prompt."""

  k: int
  temperature: float
  top_p: float


@dataclasses.dataclass(frozen=True)
class Scores:
  """A policy's held-out scores: the greedy accuracy and, with evaluation at k, `heldout_avg@K` and
  `heldout_pass@K` (`at_k`; empty without)."""

  accuracy: float
  at_k: dict[str, float] = dataclasses.field(default_factory=dict)

  def metrics(self) -> dict[str, float]:
    """A row's evaluation keys."""
    return {"heldout_accuracy": self.accuracy, **self.at_k}

  def line(self) -> str:
    """'0.312 (avg@8 0.281, pass@8 0.594)', for a log line."""
    extra = ", ".join(f"{key.removeprefix('heldout_')} {value:.3f}" for key, value in self.at_k.items())
    return f"{self.accuracy:.3f}" + (f" ({extra})" if extra else "")


@dataclasses.dataclass(frozen=True)
class HeldOut:
  """Greedy accuracy on `prompts` prompts of the held-out `task` drawn with `seed`, scored by the run's rewards: the
  policy decoded with `sampler`'s engine and `max_new_tokens`, or, for an agent task, served to one episode of the
  agent program per prompt; with `sampled`, also avg@k and pass@k. Every policy of a run (the lead's, an arm's) is
  evaluated by the same one."""

  tokenizer: object
  task: object
  sampler: SamplerConfig
  max_new_tokens: int
  prompts: int
  seed: int
  sampled: Sampled | None = None

  def __post_init__(self):
    if self.sampled is not None and self.sampler.env.agent:
      raise ValueError("JobConfig.eval_k: evaluation at k of an agent task (EnvConfig.agent) is not built; leave "
                       "eval_k at 0 (the greedy accuracy is measured)")

  def rows(self, model) -> list[tuple[str, str, float]]:
    """(prompt, completion text, reward) of each held-out prompt."""
    if self.sampler.env.agent:
      return agent_completions(model, self.tokenizer, self.task, self.sampler, self.max_new_tokens, self.prompts,
                               self.seed)
    knobs = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens, stop_token_ids=self.tokenizer.stop_ids)
    return [row for group in decoded(model, self.tokenizer, self.task, self.sampler, knobs, self.prompts, self.seed)
            for row in group]

  def accuracy(self, model, record: Path | None = None) -> float:
    """The share of held-out prompts answered correctly; with `record`, every row is written there (JSON lines)."""
    rows = self.rows(model)
    if record is not None:
      write_eval_rows(record, rows)
    return accuracy([r for _, _, r in rows])

  def scores(self, model, record: Path | None = None) -> Scores:
    """The greedy accuracy (its rows written to `record`) and, with `sampled`, avg@k and pass@k (their rows to
    `record`'s sibling ending `_at_k.jsonl`)."""
    greedy = self.accuracy(model, record)
    if self.sampled is None:
      return Scores(greedy)
    s = self.sampled
    knobs = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=self.max_new_tokens,
                           stop_token_ids=self.tokenizer.stop_ids, num_samples=s.k)
    groups = decoded(model, self.tokenizer, self.task, self.sampler, knobs, self.prompts, self.seed)
    if record is not None:
      write_eval_rows(Path(record).with_name(Path(record).stem + "_at_k.jsonl"), [r for g in groups for r in g])
    return Scores(greedy, at_k([[r for _, _, r in group] for group in groups], s.k))


def held_out_of(job: JobConfig, tokenizer, task, sampler: SamplerConfig, max_new_tokens: int) -> HeldOut:
  """The run's `HeldOut` of `task` (its eval split): `job`'s prompts, seed and evaluation at k."""
  sampled = Sampled(job.eval_k, job.eval_temperature, job.eval_top_p) if job.eval_k else None
  return HeldOut(tokenizer, task, sampler, max_new_tokens, job.eval_prompts, job.seed, sampled)


@functools.lru_cache(maxsize=4)
def _engine(graphdef, model_config: ModelConfig, config: EngineConfig):
  """One engine per model and engine config, kept: an evaluation after the first (every `JobConfig.eval_every` steps,
  after RL, each arm's) runs the programs the first traced, rather than tracing and lowering a new engine's anew."""
  return make_engine(graphdef, model_config, config, single_device_mesh())


def decoded(model, tokenizer, task, sampler: SamplerConfig, knobs: SamplingParams, prompts: int,
            seed: int) -> list[list[tuple[str, str, float]]]:
  """Each held-out prompt's `knobs.num_samples` (prompt, completion text, reward) rows, in prompt order: `prompts`
  prompts drawn with their own seed, decoded with `sampler`'s engine and tools, scored by its rewards."""
  graphdef, params = nnx.split(model)
  engine = _engine(graphdef, model.config, sampler.engine)
  tools = make_tools(sampler.env, tokenizer)
  streaming = StreamingSampler([engine], params, tools=tools)
  items = heldout_prompts(task, prompts, seed)
  ids = {rid: (i, p, row) for i, (p, row) in enumerate(items)
         for rid in streaming.submit(prompt_tokens(task, tokenizer, p), knobs)}
  out = {}
  with RewardScorer(sampler.reward, builtin=verifier(task)) as scorer:
    for sample in streaming.stream():
      (_, prompt, row), text = ids[sample.request_id], tokenizer.decode(sample.completion_tokens)
      scorer.submit(sample.request_id, question(task, prompt), text, row.fields, evaluation_where(prompt, row))
      out[sample.request_id] = (prompt, text, sample.env_reward)
    while scorer.pending:
      scorer.wait(1.0)
      for request_id, score in scorer.done():
        prompt, text, env_reward = out[request_id]
        out[request_id] = (prompt, text, score.total + env_reward)
  if tools is not None:
    tools.close()
  groups = [[] for _ in items]
  for request_id in sorted(out):
    groups[ids[request_id][0]].append(out[request_id])
  return groups
