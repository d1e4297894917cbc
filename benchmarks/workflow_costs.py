"""The step graph's cost inside a step, and a judge's (issue 81): the CPU demo's run (its gin values, a tiny decoder
warmed up for a few supervised steps) in async mode. `benchmarks/pipeline.py` runs it on its model (`costs`); alone,
`python benchmarks/workflow_costs.py`.

1. The `grpo` graph, every call of the trainer's flow (`StageFlow.run` and its row sums: the stages between the
   rewards and the update, advantages included) timed as the run trains.
2. The same run on 4 sampler and 2 trainer devices (the trainer's shapes compiled before the first step), its reward
   the task's rule, then the `judge` graph: a judge of the demo decoder's shape (random weights) on a pool of the 2
   devices left, scoring every sample; each twice, interleaved, the better kept.

Figures (alone: one JSON object as the last line): graph_overhead_frac (the flow's seconds / the steps' wall seconds, the
first step left out), flow_ms_per_step, advantage_ms_per_step (the estimator alone over the same shards, timed
apart), graph_step_s, judge_vs_rule_samples_per_s (samples per second of the judge run / the rule's, after the first
step), rule_samples_per_s, judge_samples_per_s (and alone: steps and cpu).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from streamrl_jax import gin_config  # noqa: E402
from streamrl_jax.job.warmup import supervised_warmup  # noqa: E402
from streamrl_jax.models import CharTokenizer, Transformer  # noqa: E402
from streamrl_jax.models.dtype_probe import machine  # noqa: E402
from streamrl_jax.models.hf_io import save_hf  # noqa: E402
from streamrl_jax.pipeline.runner import run_pipeline  # noqa: E402
from streamrl_jax.training import compute_advantages  # noqa: E402
from streamrl_jax.workflow import WorkflowConfig  # noqa: E402
from streamrl_jax.workflow.flow import StageFlow  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import size  # noqa: E402

STEPS = size(8, 4)
WARMUP = size(100, 20)  # supervised steps before RL
ROUNDS = size(2, 1)  # runs of each of the rule-scored and the judge's, interleaved (the better kept)


class TimedFlow:
  """StageFlow.run and .sums wrapped: seconds by step (the shards' `fields` kept for the estimator's timing)."""

  def __init__(self):
    self.seconds, self.shards = [], []
    self._run, self._sums = StageFlow.run, StageFlow.sums

  def install(self):
    timed = self

    def run(flow, fields):
      begin = time.perf_counter()
      out = timed._run(flow, fields)
      timed.seconds.append(time.perf_counter() - begin)
      timed.shards.append({k: fields[k] for k in ("rewards", "group_ids")})
      return out

    def sums(flow, fields):
      begin = time.perf_counter()
      out = timed._sums(flow, fields)
      timed.seconds[-1] += time.perf_counter() - begin
      return out
    StageFlow.run, StageFlow.sums = run, sums


def main() -> dict:
  return dict(costs(*warmed_demo(STEPS, WARMUP)), steps=STEPS, cpu=machine().split(" | ")[1])


def warmed_demo(steps: int, warmup: int) -> tuple:
  """(config, model, tokenizer, task): the CPU demo's gin values at `steps` RL steps and its decoder after `warmup`
  supervised steps; what these costs and `pipeline.py`'s modes run on."""
  gin_config.parse([gin_config.DEMO_CONFIG])
  config, job = gin_config.build_run()
  config = dataclasses.replace(config, steps=steps)
  job = dataclasses.replace(job, warmup_steps=warmup)
  tokenizer, task = CharTokenizer(), job.make_task()
  model = Transformer(job.model_config(tokenizer), rngs=nnx.Rngs(0))
  model = supervised_warmup(model, tokenizer, task, job, config.sampler.engine.max_prompt_length + config.max_new_tokens)
  return config, model, tokenizer, task


def costs(config, model, tokenizer, task) -> dict:
  """The figures, from runs of `config` (its mode made async) on `model`."""
  config = dataclasses.replace(config, mode="async")
  return {**_overhead(config, model, tokenizer, task), **_judge_vs_rule(config, model, tokenizer, task)}


def _overhead(config, model, tokenizer, task) -> dict:
  timed = TimedFlow()
  timed.install()
  try:
    result = run_pipeline(config, model, tokenizer, task)
  finally:
    StageFlow.run, StageFlow.sums = timed._run, timed._sums
  steps = config.steps
  per_step = len(timed.seconds) // steps  # groups a step (no backfill in the demo)
  steady = slice(per_step, None)  # the first step left out (compiles)
  wall = sum(m["step_s"] for m in result.metrics[1:])
  flow_s = sum(timed.seconds[steady])
  begin = time.perf_counter()
  for fields in timed.shards[steady]:
    compute_advantages(config.workflow.advantage, fields["rewards"], fields["group_ids"])
  direct_s = time.perf_counter() - begin
  return dict(graph_overhead_frac=flow_s / wall, flow_ms_per_step=1e3 * flow_s / (steps - 1),
              advantage_ms_per_step=1e3 * direct_s / (steps - 1),
              graph_step_s=float(np.median([m["step_s"] for m in result.metrics[1:]])))


def _judge_vs_rule(config, model, tokenizer, task) -> dict:
  """Samples/s after the first step of the run scored by the task's rule, then by a judge on a pool of its own (each
  `ROUNDS` times, interleaved, the better kept; the trainer's shapes compiled before the first step)."""
  with tempfile.TemporaryDirectory() as folder:
    save_hf(Transformer(model.config, rngs=nnx.Rngs(11)), Path(folder) / "judge")
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, sampler_devices=4, trainer_devices=2),
                                 trainer=dataclasses.replace(config.trainer, precompile=True))
    judge = WorkflowConfig(graph="judge", judge=str(Path(folder) / "judge"), pools=("judge=2",), bind=("judge=judge",))
    rates = {"rule": 0.0, "judge": 0.0}
    for name, workflow in (("rule", config.workflow), ("judge", judge)) * ROUNDS:
      steady = run_pipeline(dataclasses.replace(config, workflow=workflow), model, tokenizer, task).metrics[1:]
      samples = config.samples_per_step * len(steady)
      rates[name] = max(rates[name], samples / sum(m["step_s"] for m in steady))
  return dict(judge_vs_rule_samples_per_s=rates["judge"] / rates["rule"], rule_samples_per_s=rates["rule"],
              judge_samples_per_s=rates["judge"])


if __name__ == "__main__":
  print(json.dumps(main()))
