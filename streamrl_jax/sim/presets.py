"""Named scenarios: the StreamRL paper's settings, and one calibrated by this project's CPU benchmarks."""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.scheduling import resource_split
from streamrl_jax.sim.preset_names import PAPER, PRESETS, SCALING, SCALING_MODELS
from streamrl_jax.sim.pipeline import (SimBatchConfig, SimConfig, SimSamplerConfig, SimSyncConfig, SimTrainerConfig,
                                       generation, moved_field, simulate, train_seconds)
from streamrl_jax.sim.profiles import H20, QWEN25, Hardware, LengthDistribution, ModelSpec

# Measured here: benchmarks/sampler.py (ptl_ms_by_batch) and benchmarks/trainer.py (train_mfu) on 2 CPU cores.
CPU_2CORE = Hardware("cpu-2core", bf16_tflops=0.16, memory_gb=24.0, bandwidth_tbs=0.02, cost_per_hour=0.05)
LOCAL_MODEL = ModelSpec("streamrl-10m", params_b=0.00997, layers=8, kv_heads=2, head_dim=64)
LOCAL_PTL = ((1, 5.3e-3), (2, 5.6e-3), (4, 6.7e-3), (8, 8.3e-3), (16, 11.0e-3), (32, 17.8e-3))

# Samplers in another datacenter (StreamRL's H20 case): 200 Gb/s trainer and sampler links, 10 Gb/s between.
CROSS_DATACENTER = SimSyncConfig(bandwidth_gbs=25.0, sampler_link_gbs=25.0, inter_site_gbs=1.25)


def preset(name: str, **overrides) -> SimConfig:
  """The named scenario, `overrides` (SimConfig fields, a part given whole) replacing its fields."""
  moved_field(overrides)
  if name == SCALING:
    return scaling_preset("7b", **overrides)
  if name == "local-cpu":
    fields = dict(model=LOCAL_MODEL, lengths=LengthDistribution(median=24, sigma=0.9, max_len=256),
                  total_devices=8, sampler_devices=4, tensor_parallel=1, iterations=3,
                  batch=SimBatchConfig(global_batch=128, prompt_len=24),
                  sampler=SimSamplerConfig(hardware=CPU_2CORE, ptl_curve=LOCAL_PTL, max_batch=32),
                  trainer=SimTrainerConfig(hardware=CPU_2CORE, mfu=0.28, optimizer_step_s=0.05, colocated_switch_s=0.0),
                  sync=SimSyncConfig(latency_s=0.001))
    fields.update(overrides)
    return SimConfig(**fields)
  if name == "cross-datacenter":  # every sampler engine at the second site; one copy of a version crosses
    config = preset("paper-32b-h20-sampler", sync=CROSS_DATACENTER)
    engines = max(1, config.generation_devices // config.tensor_parallel)
    sync = dataclasses.replace(config.sync, sampler_sites=(0, engines))
    return dataclasses.replace(config, **{"sync": sync, **overrides})
  if name == "paper-32b-h20-sampler":
    config = preset("paper-32b-10k", sampler=SimSamplerConfig(hardware=H20))
    return dataclasses.replace(config, **overrides)
  if name not in PAPER:
    raise ValueError(f"unknown preset {name!r}; known: {PRESETS}")
  model, max_len, devices, tp = PAPER[name]
  lengths = LengthDistribution(median=max_len / 6, sigma=0.9, max_len=max_len)
  fields = dict(model=QWEN25[model], lengths=lengths, total_devices=devices, sampler_devices=devices // 2,
                tensor_parallel=tp, batch=SimBatchConfig(global_batch=1024), iterations=3)
  fields.update(overrides)
  return SimConfig(**fields)


def scaling_preset(model: str = "7b", **overrides) -> SimConfig:
  """`distflow-scaling`'s base for `model` ("7b" or "72b"): its paper preset, async and skew-aware, versions published
  over 25 GB/s links (a host's NIC, as the data plane's), today's central data plane unless overridden."""
  if model not in SCALING_MODELS:
    raise ValueError(f"unknown scaling model {model!r}; known: {list(SCALING_MODELS)}")
  config = preset(SCALING_MODELS[model], mode="async", dispatch="skew_aware", sync=SimSyncConfig(bandwidth_gbs=25.0))
  return dataclasses.replace(config, **overrides)


def expected_generation_s(config: SimConfig, devices: int, samples: int = 2) -> float:
  rng = np.random.default_rng(config.seed)
  times = [generation(config, config.lengths.sample(rng, config.batch.global_batch), rng, devices)[0].max()
           for _ in range(samples)]
  return float(np.mean(times))


def balanced_split(config: SimConfig) -> tuple[int, int]:
  """The sampler/trainer split minimising max(T_gen, T_train), by the scheduling policy."""
  rng = np.random.default_rng(config.seed)
  tokens = float(np.mean(config.lengths.sample(rng, 4096))) + config.batch.prompt_len
  return resource_split(config.total_devices, lambda s: expected_generation_s(config, s),
                        lambda t: train_seconds(config, tokens * config.batch.global_batch, t),
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
