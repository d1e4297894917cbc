"""Weights updated in flight against updates between samples, across processes, and dynamic sampling.

Every arm runs as `streamrl launch local --pin-cores`: the trainer on one CPU core, one sampler on the other,
joined by Arrow Flight on loopback, all in async mode (staleness 1) from one shared warm-up.

- Long-tailed workload (that of `benchmarks/multiprocess.py`: arithmetic of up to 8 digits, most answers short
  and a few long, 128 samples a step, 10 steps, the first 3 left out of the rates):
  `between` (a sampler takes new weights only at a lease boundary; its next lease waits for the last one's
  longest row), `in_flight` (the next lease starts while the last one's rows run; new weights are applied
  between two decode calls, rows keep their KV cache) and `in_flight_recompute` (rows in flight are prefilled
  again with the new weights). `inflight_vs_between_samples` is the samples/s ratio; `trainer_idle_frac` the
  in-flight trainer's share of each step spent waiting for samples; `max_token_staleness` the largest
  step - version over every trained token.
- Dynamic sampling on the same workload, in flight: groups whose rewards are all equal are not trained and the
  step is backfilled; `equal_reward_groups_trained` must be 0.
- The demo task (`configs/demo_cpu.gin`, DEMO_STEPS steps): held-out greedy accuracy of `stream` (on-policy)
  minus that of async in flight, `accuracy_gap_vs_stream`.

Prints one JSON object as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from multiprocess import SKIP, STEPS, WORKLOAD, streamrl, warm_up  # noqa: E402

LONG_TAIL = {
    "between": ("PipelineConfig.mode='async'",),
    "in_flight": ("PipelineConfig.mode='async'", "PipelineConfig.in_flight=True"),
    "in_flight_recompute": ("PipelineConfig.mode='async'", "PipelineConfig.in_flight=True",
                            "PipelineConfig.in_flight_cache='recompute'"),
    "dynamic_sampling": ("PipelineConfig.mode='async'", "PipelineConfig.in_flight=True",
                         "PipelineConfig.dynamic_sampling=True"),
}
DEMO_STEPS = 48
DEMO = ("MeshConfig.sampler_devices=0", "MeshConfig.trainer_devices=0")
DEMO_ARMS = {"stream": ("PipelineConfig.mode='stream'", f"PipelineConfig.steps={DEMO_STEPS}"),
             "in_flight": ("PipelineConfig.mode='async'", "PipelineConfig.in_flight=True",
                           f"PipelineConfig.steps={DEMO_STEPS}")}


def launch(workdir: Path, warm: Path, workload: tuple[str, ...], sets: tuple[str, ...]) -> tuple[list[dict], dict]:
  """One run across processes; (per-step metrics, summary.json)."""
  workdir.mkdir(parents=True)
  (workdir / "warmup_model").symlink_to(warm)
  argv = streamrl("launch", "local", "--workdir", str(workdir), "--pin-cores", workload=workload)
  argv += [a for s in sets for a in ("--set", s)]
  done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"{sets} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return metrics, json.loads((workdir / "summary.json").read_text())


def steady_rates(metrics: list[dict]) -> dict:
  steady = metrics[SKIP:]
  seconds = sum(m["step_s"] for m in steady)
  return dict(samples_per_s=round(sum(m["samples_per_s"] * m["step_s"] for m in steady) / seconds, 2),
              trainer_idle_frac=round(float(np.mean([m["trainer_idle_frac"] for m in steady])), 3),
              step_s=round(float(np.mean([m["step_s"] for m in steady])), 3),
              max_token_staleness=max(m["staleness_max"] for m in metrics),
              token_staleness_mean=round(float(np.mean([m["staleness_mean"] for m in metrics])), 3))


def main() -> dict:
  out: dict = {"long_tail": {}, "demo": {}}
  with tempfile.TemporaryDirectory(prefix="streamrl-inflight-") as tmp:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tmp) / "xla"))  # compiles shared by the runs
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    warm = warm_up(Path(tmp) / "warm")
    for arm, sets in LONG_TAIL.items():
      metrics, _ = launch(Path(tmp) / arm, warm, WORKLOAD, sets)
      out["long_tail"][arm] = steady_rates(metrics)
      if arm == "dynamic_sampling":
        out["long_tail"][arm].update({k: sum(m[k] for m in metrics) for k in (
            "groups_filtered", "groups_backfilled", "prompts_leased", "equal_reward_groups_trained")})
      print(arm, out["long_tail"][arm], file=sys.stderr, flush=True)
    demo_warm = warm_up(Path(tmp) / "demo_warm", workload=DEMO)
    for arm, sets in DEMO_ARMS.items():
      metrics, summary = launch(Path(tmp) / f"demo_{arm}", demo_warm, DEMO, sets)
      out["demo"][arm] = dict(accuracy_before=summary["accuracy_before"], accuracy_after=summary["accuracy_after"],
                              rl_seconds=round(summary["rl_seconds"], 1), **steady_rates(metrics))
      print("demo", arm, out["demo"][arm], file=sys.stderr, flush=True)
  arms, demo = out["long_tail"], out["demo"]
  dynamic = arms["dynamic_sampling"]
  out.update(
      inflight_vs_between_samples=round(arms["in_flight"]["samples_per_s"] / arms["between"]["samples_per_s"], 3),
      recompute_vs_keep=round(arms["in_flight_recompute"]["samples_per_s"] / arms["in_flight"]["samples_per_s"], 3),
      trainer_idle_frac=arms["in_flight"]["trainer_idle_frac"],
      trainer_idle_frac_between=arms["between"]["trainer_idle_frac"],
      max_token_staleness=max(arms[a]["max_token_staleness"] for a in ("in_flight", "in_flight_recompute")),
      accuracy_gap_vs_stream=round(demo["stream"]["accuracy_after"] - demo["in_flight"]["accuracy_after"], 4),
      equal_reward_groups_trained=dynamic["equal_reward_groups_trained"], groups_filtered=dynamic["groups_filtered"],
      groups_backfilled=dynamic["groups_backfilled"], workload=list(WORKLOAD), steps=STEPS, skipped_steps=SKIP,
      demo_steps=DEMO_STEPS)
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
