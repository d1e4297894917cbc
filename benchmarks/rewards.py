"""Rewards off the decode loop: what a slow verifier and scoring itself cost the sampler, and the worked example.

Part `throughput` (about 3 min): the async pipeline on the CPU demo's model and batch (untrained, so every
completion runs to max_new_tokens: the same decode work in every variant), scored five ways, interleaved, each
measured as the sampler's samples per second of generation (a lease's samples over the seconds from its start
until its last group was scored and sent; the first step, which compiles, left out):
  none            the task's own verifier in the sampler's thread (a constant: no scoring work)
  instant_inline  a configured instant function, workers=0 (in the sampler's thread)
  instant_workers a configured instant function, 4 worker processes
  slow_workers    a function sleeping 50 ms a call, 4 worker processes
  slow_inline     the same in the sampler's thread (what a slow verifier costs when it blocks decoding)
slow_reward_throughput_ratio = slow_workers / instant_workers (goal >= 0.8); reward_overhead = 1 - instant_inline
/ none (goal <= 0.05).

Part `example` (about 6 min): examples/own_task on SmolLM2-135M-Instruct for EXAMPLE_STEPS steps: held-out
greedy accuracy before and after (example_accuracy_before, example_accuracy_after).

Prints one JSON object as its last line. `--part throughput|example` runs one part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from streamrl_jax import gin_config  # noqa: E402
from streamrl_jax.models import CharTokenizer, Transformer  # noqa: E402
from streamrl_jax.pipeline import run_pipeline  # noqa: E402
from streamrl_jax.rewards import RewardConfig  # noqa: E402
from streamrl_jax.tasks import ArithmeticTask  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
ROUNDS = 2
SLOW_S = 0.05
EXAMPLE_STEPS = 6
FUNCTIONS = f'''
import time

def instant(prompt, completion, **fields):
  return float(len(completion) % 2)

def slow(prompt, completion, **fields):
  time.sleep({SLOW_S})
  return float(len(completion) % 2)
'''


class ConstantTask(ArithmeticTask):
  """The demo's prompts with a reward that does nothing: the 'none' variant's verifier."""

  @staticmethod
  def reward(prompt: str, completion: str) -> float:
    return 0.0


def throughput() -> dict:
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="rewards-bench-cache-"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  gin_config.parse([gin_config.DEMO_CONFIG])
  config, job = gin_config.build_run()
  config = dataclasses.replace(config, steps=STEPS, mode="async")
  tokenizer = CharTokenizer()
  model = Transformer(job.model_config(tokenizer), rngs=nnx.Rngs(0))
  module = Path(tempfile.mkdtemp(prefix="rewards-bench-")) / "bench_rewards.py"
  module.write_text(FUNCTIONS)
  variants = {
      "none": RewardConfig(),
      "instant_inline": RewardConfig(functions=(f"{module}:instant",), workers=0),
      "instant_workers": RewardConfig(functions=(f"{module}:instant",), workers=4),
      "slow_workers": RewardConfig(functions=(f"{module}:slow",), workers=4),
      "slow_inline": RewardConfig(functions=(f"{module}:slow",), workers=0),
  }
  rates: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(ROUNDS):
    for name, reward in variants.items():
      if name == "slow_inline" and rates[name]:
        continue  # one round shows the stall
      result = run_pipeline(dataclasses.replace(config, reward=reward), model, tokenizer,
                            ConstantTask(max_digits=job.max_digits))
      steady = result.metrics[1:]
      rates[name].append(config.samples_per_step * len(steady) / sum(m["generation_s"] for m in steady))
  rate = {name: float(np.median(v)) for name, v in rates.items()}
  return dict(samples_per_s={k: round(v, 2) for k, v in rate.items()},
              slow_reward_throughput_ratio=round(rate["slow_workers"] / rate["instant_workers"], 3),
              reward_overhead=round(1 - rate["instant_inline"] / rate["none"], 3),
              slow_inline_ratio=round(rate["slow_inline"] / rate["instant_workers"], 3),
              samples_per_step=config.samples_per_step, steps=STEPS, rounds=ROUNDS, slow_call_s=SLOW_S, workers=4)


def example() -> dict:
  from streamrl_jax.pipeline.train_job import train_job

  os.chdir(ROOT)  # the example's paths start at the repository's root
  gin_config.parse([ROOT / "examples/own_task/own_task.gin"], [f"PipelineConfig.steps = {EXAMPLE_STEPS}"])
  config, job = gin_config.build_run()
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    summary = train_job(config, job, workdir, log=lambda *_: None)
    metrics = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return dict(example_accuracy_before=round(summary["accuracy_before"], 3),
              example_accuracy_after=round(summary["accuracy_after"], 3), example_steps=EXAMPLE_STEPS,
              example_reward_curve=[round(m["reward_mean"], 3) for m in metrics],
              example_correct_curve=[round(m["reward/correct"], 3) for m in metrics],
              example_unit_curve=[round(m["reward/states_unit"], 3) for m in metrics],
              example_wall_s=round(time.perf_counter() - start, 1))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--part", choices=("all", "throughput", "example"), default="all")
  part = parser.parse_args(argv).part
  out = {}
  if part in ("all", "throughput"):
    out.update(throughput())
  if part in ("all", "example"):
    out.update(example())
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
