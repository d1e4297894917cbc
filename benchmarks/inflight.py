"""Weights updated in flight against updates between samples, across processes, and dynamic sampling.

Every arm runs as `streamrl launch local --pin-cores` on the CPU demo (`configs/demo_cpu.gin`: long-tailed
additions of up to 4 digits, most answers short and a few long, 16 prompts x 8 samples a step, 32 engine
slots), DEMO_STEPS steps from one shared warm-up: the trainer on one CPU core, one sampler on the other, joined
by Arrow Flight on loopback. The first SKIP steps (compiles, the pipeline filling) are left out of the rates.

- `between` (async as before in_flight: one lease at a time, so a sampler's next lease waits for the last
  one's longest row; newer weights are still taken between decode calls inside a lease), `in_flight` (the next lease starts while the last one's rows
  run; new weights are applied between two decode calls, rows keep their KV cache) and `in_flight_recompute`
  (rows in flight are prefilled again with the new weights): `inflight_vs_between_samples` is the samples/s
  ratio; `trainer_idle_frac` the in-flight trainer's share of each step spent waiting for samples;
  `max_token_staleness` the largest step - version over every trained token.
- `stream` (on-policy): `accuracy_gap_vs_stream` is its held-out greedy accuracy minus in-flight's.
- `dynamic_sampling` (in flight): groups whose rewards are all equal are not trained and the step is
  backfilled; `equal_reward_groups_trained` must be 0.
- The sampler alone (`sampler_arms`), where it is the bottleneck: back-to-back leases of a long-tailed workload
  with a new version after each, drained between leases or in flight: `sampler_inflight_vs_between`.

Prints one JSON object as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from multiprocess import streamrl, warm_up  # noqa: E402
from sizing import QUICK, size  # noqa: E402

DEMO_STEPS, SKIP = size(48, 4), size(3, 2)
# precompile: every trainer shape compiled before the first step, so no arm pays compiles that a later arm
# finds in the shared compilation cache (the first arm run used to train at half speed for it)
DEMO = ("MeshConfig.sampler_devices=0", "MeshConfig.trainer_devices=0", "TrainerConfig.precompile=True",
        # quick: a shorter supervised warm-up than the demo's 300 steps, a quarter of its 128 held-out prompts
        *size((), ("JobConfig.warmup_steps=30", "JobConfig.eval_prompts=32")))
# sampler_arms: leases; requests per lease (None: all 128); output lengths divided by (quick: the tail 50-64 tokens)
SAMPLER_LEASES, SAMPLER_REQUESTS, SAMPLER_LENGTH_DIV = size(5, 2), size(None, 48), size(1, 4)
ARMS = {  # in flight first: what a first arm might still pay counts against it
    "in_flight": ("PipelineConfig.mode='async'", "SamplerConfig.in_flight=True"),
    "between": ("PipelineConfig.mode='async'",),
    "in_flight_recompute": ("PipelineConfig.mode='async'", "SamplerConfig.in_flight=True",
                            "SamplerConfig.in_flight_cache='recompute'"),
    "stream": ("PipelineConfig.mode='stream'",),
    "dynamic_sampling": ("PipelineConfig.mode='async'", "SamplerConfig.in_flight=True",
                         "ControllerConfig.dynamic_sampling=True"),
}
if QUICK:  # recompute left out (recompute_vs_keep has no goal), stream too (its accuracy gap is a full run's)
  del ARMS["in_flight_recompute"], ARMS["stream"]


def launch(workdir: Path, warm: Path | None, workload: tuple[str, ...], sets: tuple[str, ...]
           ) -> tuple[list[dict], dict]:
  """One run across processes; (per-step metrics, summary.json). `warm`: the warm-up model to start from (None:
  this run's trainer does the supervised warm-up itself and saves it in WORKDIR/warmup_model)."""
  workdir.mkdir(parents=True)
  if warm is not None:
    (workdir / "warmup_model").symlink_to(warm)
  argv = streamrl("launch", "local", "--workdir", str(workdir), "--pin-cores", workload=workload)
  argv += [a for s in sets + (f"PipelineConfig.steps={DEMO_STEPS}",) for a in ("--set", s)]
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
              generation_s=round(float(np.mean([m["generation_s"] for m in steady])), 3),
              train_s=round(float(np.mean([m["train_s"] for m in steady])), 3),
              max_token_staleness=max(m["staleness_max"] for m in metrics),
              token_staleness_mean=round(float(np.mean([m["staleness_mean"] for m in metrics])), 3))


def sampler_arms(leases: int = SAMPLER_LEASES, rounds: int = 1) -> dict:
  """The sampler alone, where it is the bottleneck: `leases` leases of benchmarks/sampler.py's long-tailed
  workload (128 requests, 15% of them 200-256 tokens, 32 slots, ~10M parameters), a new weight version after
  each. `between`: a lease drains before the next one starts and the version is taken in between; `in_flight`:
  the next lease and its version come as soon as every request of the last is admitted. Samples/s, the two
  interleaved over `rounds` after a warm-up."""
  import jax
  from flax import nnx
  from model_forward import CONFIG
  from sampler import MAX_NEW, MAX_PROMPT, SLOTS, workload

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.models import Transformer
  from streamrl_jax.sampling import DecodeEngine, EngineConfig, StreamingSampler
  from streamrl_jax.types import SamplingParams
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  engine = DecodeEngine(graphdef, CONFIG, EngineConfig(num_slots=SLOTS, max_prompt_length=MAX_PROMPT,
                                                       max_new_tokens=MAX_NEW, steps_per_sync=4),
                        mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1)))
  work = [(prompts[:SAMPLER_REQUESTS], [n // SAMPLER_LENGTH_DIV for n in lengths[:SAMPLER_REQUESTS]])
          for prompts, lengths in map(workload, range(leases))]

  def run(in_flight: bool) -> float:
    sampler = StreamingSampler([engine], params)
    start, finished, submitted = time.perf_counter(), 0, 0
    while finished < leases * len(work[0][0]):
      ready = not sampler.has_work() or (in_flight and sampler.num_pending == 0)
      if submitted < leases and ready:
        if submitted:
          sampler.update_params(params, version=submitted)
        for g, (prompt, length) in enumerate(zip(*work[submitted])):
          sampler.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=length), group_id=submitted * 1000 + g)
        submitted += 1
      finished += len(sampler.step())
    return finished / (time.perf_counter() - start)

  run(True)  # compiles
  rates = {"between": [], "in_flight": []}
  for _ in range(rounds):
    for arm in rates:
      rates[arm].append(run(arm == "in_flight"))
  out = {arm: round(float(np.median(r)), 2) for arm, r in rates.items()}
  print("sampler", out, file=sys.stderr, flush=True)
  return dict(sampler_samples_per_s=out, sampler_inflight_vs_between=round(out["in_flight"] / out["between"], 3))


def main() -> dict:
  out: dict = {"arms": {}, **sampler_arms()}
  with tempfile.TemporaryDirectory(prefix="streamrl-inflight-") as tmp:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tmp) / "xla"))  # compiles shared by the runs
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # quick: no warm-up run; the first arm's trainer warms up before its steps, the other arms start from its model
    warm = None if QUICK else warm_up(Path(tmp) / "warm", workload=DEMO)
    for arm, sets in ARMS.items():
      metrics, summary = launch(Path(tmp) / arm, warm, DEMO, sets)
      warm = warm or Path(tmp) / arm / "warmup_model"
      result = out["arms"][arm] = dict(accuracy_after=summary["accuracy_after"],
                                       rl_seconds=round(summary["rl_seconds"], 1), **steady_rates(metrics))
      if arm == "dynamic_sampling":
        result.update({k: sum(m[k] for m in metrics) for k in (
            "groups_filtered", "groups_backfilled", "prompts_leased", "equal_reward_groups_trained")})
      out["accuracy_before"] = summary["accuracy_before"]
      print(arm, result, file=sys.stderr, flush=True)
  arms = out["arms"]
  dynamic, recompute = arms["dynamic_sampling"], arms.get("in_flight_recompute")  # recompute: not in a quick run
  out.update(
      inflight_vs_between_samples=round(arms["in_flight"]["samples_per_s"] / arms["between"]["samples_per_s"], 3),
      recompute_vs_keep=recompute and round(recompute["samples_per_s"] / arms["in_flight"]["samples_per_s"], 3),
      trainer_idle_frac=arms["in_flight"]["trainer_idle_frac"],
      trainer_idle_frac_between=arms["between"]["trainer_idle_frac"],
      max_token_staleness=max(a["max_token_staleness"] for a in (arms["in_flight"], recompute) if a),
      accuracy_gap_vs_stream=(round(arms["stream"]["accuracy_after"] - arms["in_flight"]["accuracy_after"], 4)
                              if "stream" in arms else None),
      equal_reward_groups_trained=dynamic["equal_reward_groups_trained"], groups_filtered=dynamic["groups_filtered"],
      groups_backfilled=dynamic["groups_backfilled"], workload=list(DEMO), steps=DEMO_STEPS, skipped_steps=SKIP)
  if QUICK:
    out["quick_omits"] = ["accuracy_gap_vs_stream"]
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
