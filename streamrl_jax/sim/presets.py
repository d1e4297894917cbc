"""Named scenarios: the StreamRL paper's settings, and one calibrated by this project's CPU benchmarks."""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.scheduling import resource_split
from streamrl_jax.sim.pipeline import SimConfig, generation, simulate, train_seconds
from streamrl_jax.sim.profiles import H20, QWEN25, LengthDistribution

PAPER = {
    # name: (model, max output length, devices, tensor parallel)
    "paper-7b-5k": ("7b", 5000, 32, 1),
    "paper-32b-10k": ("32b", 10000, 64, 4),
    "paper-72b-20k": ("72b", 20000, 128, 8),
}


def preset(name: str, **overrides) -> SimConfig:
  if name == "paper-32b-h20-sampler":
    config = preset("paper-32b-10k", sampler_hardware=H20)
    return dataclasses.replace(config, **overrides)
  if name not in PAPER:
    raise ValueError(f"unknown preset {name!r}; known: {sorted(PAPER) + ['paper-32b-h20-sampler']}")
  model, max_len, devices, tp = PAPER[name]
  lengths = LengthDistribution(median=max_len / 6, sigma=0.9, max_len=max_len)
  fields = dict(model=QWEN25[model], lengths=lengths, total_devices=devices, sampler_devices=devices // 2,
                tensor_parallel=tp, global_batch=1024, iterations=3)
  fields.update(overrides)
  return SimConfig(**fields)


def expected_generation_s(config: SimConfig, devices: int, samples: int = 2) -> float:
  rng = np.random.default_rng(config.seed)
  times = [generation(config, config.lengths.sample(rng, config.global_batch), rng, devices)[0].max()
           for _ in range(samples)]
  return float(np.mean(times))


def balanced_split(config: SimConfig) -> tuple[int, int]:
  """The sampler/trainer split minimising max(T_gen, T_train), by the scheduling policy."""
  rng = np.random.default_rng(config.seed)
  tokens = float(np.mean(config.lengths.sample(rng, 4096))) + config.prompt_len
  return resource_split(config.total_devices, lambda s: expected_generation_s(config, s),
                        lambda t: train_seconds(config, tokens * config.global_batch, t),
                        sampler_unit=config.tensor_parallel)


def ablation_ladder(config: SimConfig) -> dict:
  """The paper's ladder: colocated, + skew-aware dispatch, + disaggregation and streaming, + async."""
  sampler, _ = balanced_split(dataclasses.replace(config, dispatch="skew_aware"))
  runs = {
      "colocated": dataclasses.replace(config, mode="colocated", dispatch="random"),
      "skew_aware": dataclasses.replace(config, mode="colocated", dispatch="skew_aware"),
      "disaggregated_stream": dataclasses.replace(config, mode="stream", dispatch="skew_aware",
                                                  sampler_devices=sampler),
      "async": dataclasses.replace(config, mode="async", dispatch="skew_aware", sampler_devices=sampler),
  }
  results = {name: simulate(c) for name, c in runs.items()}
  base = results["colocated"]["samples_per_s"]
  return {"normalized_throughput": {k: round(v["samples_per_s"] / base, 3) for k, v in results.items()},
          "sampler_devices": sampler, "runs": results}
