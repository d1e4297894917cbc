"""The four run modes on the same model, task, seed and number of samples (long-tailed arithmetic).

A tiny decoder warmed up for a few supervised steps (so completions have realistic, skewed lengths) runs
`STEPS` GRPO steps in each mode on 8 forced host devices (4 sampler + 4 trainer; colocated uses all 8).
The first step (compiles) is left out of the rates. Then the step graph's costs in async mode (`workflow_costs`:
the flow's share of a step, a judge's run against the rule-scored one). Prints one JSON object as its last line:
samples_per_s, trainer_idle_frac and sampler_idle_frac (dicts by mode), weight_sync_s, the ratios
stream_vs_disaggregated, async_vs_disaggregated, async_vs_colocated, and workflow_costs' figures.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from streamrl_jax.pipeline.runner import run_pipeline  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402
import workflow_costs  # noqa: E402

STEPS = size(6, 4)
SKIP = size(1, 2)  # steps left out of the rates (quick: the second step still compiles what the first did not meet)
WARMUP = size(100, 20)  # supervised steps before RL
MODES = ("colocated", "disaggregated", "stream", "async")


def main() -> dict:
  if QUICK:  # the modes' shared shapes compile once (compiles fall in the steps left out)
    cache = tempfile.mkdtemp(prefix="pipeline-bench-cache-")
    atexit.register(shutil.rmtree, cache, True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  config, model, tokenizer, task = workflow_costs.warmed_demo(STEPS, WARMUP)
  out = {k: {} for k in ("samples_per_s", "trainer_idle_frac", "sampler_idle_frac", "weight_sync_s")}
  for mode in MODES:
    result = run_pipeline(dataclasses.replace(config, mode=mode), model, tokenizer, task)
    steady = result.metrics[SKIP:]
    seconds = sum(m["step_s"] for m in steady)
    out["samples_per_s"][mode] = round(config.samples_per_step * len(steady) / seconds, 2)
    out["trainer_idle_frac"][mode] = round(float(np.mean([m["trainer_idle_frac"] for m in steady])), 3)
    out["sampler_idle_frac"][mode] = round(steady[-1]["sampler_idle_frac"], 3)
    out["weight_sync_s"][mode] = round(float(np.mean([m["weight_sync_s"] for m in steady])), 4)
  rate = out["samples_per_s"]
  out.update(stream_vs_disaggregated=round(rate["stream"] / rate["disaggregated"], 3),
             async_vs_disaggregated=round(rate["async"] / rate["disaggregated"], 3),
             async_vs_colocated=round(rate["async"] / rate["colocated"], 3), steps=STEPS,
             samples_per_step=config.samples_per_step)
  out.update(workflow_costs.costs(config, model, tokenizer, task))  # the step graph's, in async mode (issue 81)
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
