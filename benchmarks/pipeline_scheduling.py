"""Scheduling inside `run_pipeline`: generation time per step with one engine instance, two under random
dispatch + FIFO, and two instances under the ranker's skew-aware dispatch + longest-first admission.

The demo's model (warmed up for 100 supervised steps) on long-tailed arithmetic of up to 8 digits, `stream`
mode (on-policy, so each step's generation is timed on its own), 16 prompts x 8 samples per step on 4
sampler devices. Steps 1-2 (compiles, an untrained ranker) are left out. Prints one JSON object last:
generation_s (mean per step, by variant), skew_vs_fifo (two instances), ranker_recall_top20 (mean).
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
from flax import nnx  # noqa: E402

from streamrl_jax import gin_config  # noqa: E402
from streamrl_jax.models import CharTokenizer, Transformer  # noqa: E402
from streamrl_jax.pipeline.runner import run_pipeline  # noqa: E402
from streamrl_jax.job.warmup import supervised_warmup  # noqa: E402
from streamrl_jax.scheduling import SchedulingConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402

STEPS, SKIP = size(8, 4), 2
WARMUP = size(100, 20)  # supervised steps before RL
VARIANTS = {"fifo_1_replica": SchedulingConfig(), "fifo_2_replicas": SchedulingConfig(instances=2),
            "skew_2_replicas": SchedulingConfig(policy="skew_aware", instances=2)}


def main() -> dict:
  if QUICK:  # the variants' shared shapes compile once (compiles fall in the steps left out)
    cache = tempfile.mkdtemp(prefix="pipeline-scheduling-bench-cache-")
    atexit.register(shutil.rmtree, cache, True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  gin_config.parse([gin_config.DEMO_CONFIG])  # the CPU demo's values
  config, job = gin_config.build_run()
  config = dataclasses.replace(config, steps=STEPS, mode="stream")
  job = dataclasses.replace(job, warmup_steps=WARMUP, task=dataclasses.replace(job.task, max_digits=8))
  tokenizer, task = CharTokenizer(), job.make_task()
  model = Transformer(job.model_config(tokenizer), rngs=nnx.Rngs(0))
  model = supervised_warmup(model, tokenizer, task, job,
                            config.sampler.engine.max_prompt_length + config.max_new_tokens)
  generation, recall = {}, []
  for name, scheduling in VARIANTS.items():
    result = run_pipeline(dataclasses.replace(config, scheduling=scheduling), model, tokenizer, task)
    steady = result.metrics[SKIP:]
    generation[name] = round(float(np.mean([m["generation_s"] for m in steady])), 3)
    recall += [m["ranker_recall_top20"] for m in steady if "ranker_recall_top20" in m]
  return dict(generation_s=generation,
              skew_vs_fifo=round(generation["skew_2_replicas"] / generation["fifo_2_replicas"], 3),
              two_vs_one_replica=round(generation["fifo_2_replicas"] / generation["fifo_1_replica"], 3),
              ranker_recall_top20=round(float(np.mean(recall)), 3), steps=STEPS,
              samples_per_step=config.samples_per_step)


if __name__ == "__main__":
  print(json.dumps(main()))
