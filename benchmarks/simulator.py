"""Simulator speed: 1,000 RL iterations of 1,024 samples on 1,024 devices (7B, one device per engine
instance, async mode, skew-aware dispatch). Goal: under 60 s on this machine.

Prints one JSON object as its last line: seconds, iterations, samples, devices, and the ablation ladder of
the paper-72b-20k preset for reference. A quick run (`benchmarks/sizing.py`) simulates 100 iterations;
seconds_per_1000_iterations scales its time to the full run's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from streamrl_jax.sim.pipeline import SimBatchConfig
from streamrl_jax.sim.presets import ablation_ladder, preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import size  # noqa: E402

ITERATIONS = size(1000, 100)


def main() -> dict:
  config = preset("paper-7b-5k", total_devices=1024, sampler_devices=512, tensor_parallel=1, iterations=ITERATIONS,
                  mode="async", dispatch="skew_aware", batch=SimBatchConfig(global_batch=1024))
  start = time.perf_counter()
  from streamrl_jax.sim.pipeline import simulate
  result = simulate(config)
  seconds = time.perf_counter() - start
  ladder = ablation_ladder(preset("paper-72b-20k"))["normalized_throughput"]
  return {"seconds": round(seconds, 2), "seconds_per_1000_iterations": round(seconds * 1000 / config.iterations, 2),
          "iterations": config.iterations, "samples": config.batch.global_batch,
          "devices": config.total_devices, "samples_per_s_simulated": round(result["samples_per_s"], 2),
          "paper_72b_20k_normalized_throughput": ladder}


if __name__ == "__main__":
  print(json.dumps(main()))
