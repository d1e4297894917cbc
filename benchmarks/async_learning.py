"""Does asynchronous RL learn what synchronous RL learns? And is the sampler's log-probability the trainer's?

1. Learning: `streamrl train` on `configs/smollm2_cpu.gin`'s work (SmolLM2-135M-Instruct, two-digit sums asked in
   chat, 15 steps of 8 prompts x 8 samples, held-out greedy accuracy on 200 prompts before and after), the same seed
   and prompts, three ways: `colocated` (staleness 0: every step samples with the weights it trains), `async` at
   staleness 4 with the default correction (`ObjectiveConfig.correction='token_tis'`), and `async` at staleness 4
   uncorrected (`correction='none'`). Prints `accuracy_colocated`, `accuracy_async4_corrected`,
   `accuracy_async4_uncorrected`, `async4_minus_colocated` (corrected minus colocated), `accuracy_before`, and per
   run its mean trained-token staleness and mismatch (`*_staleness_mean`, `*_mismatch_kl`).
2. Several updates a step (`--part updates`): the same work with one update a step (`m1`), 4 mini-batches (`m4`:
   TrainerConfig.mini_batches=4) and 2 epochs (`e2`: TrainerConfig.epochs=2), three sampling seeds each
   (PipelineConfig.seed; the held-out prompts stay the same): `updates_accuracy_m1`, `_m4`, `_e2` (the mean after RL)
   with `_range` (max - min over the seeds), `updates_step_s_*` (the mean step after the first, which holds the
   compiles), `updates_step_ratio_m4` and `_e2` (against m1), `updates_m4_minus_m1`.
   Every run evaluates at k=8 too (JobConfig.eval_k=8, temperature 1): `updates_avg@8_m1_before` and `_after`,
   `updates_pass@8_m1_before` and `_after` (the first seed's).
3. Evaluation at k (`--part eval`): SmolLM2 before RL on the 200 held-out prompts, greedy and at k=8 (8 samples a
   prompt, temperature 1, one prefill a prompt), each timed after a first pass that compiles: `eval_greedy_s`,
   `eval_at_8_s` (the 8 samples alone), `eval_at_k_cost_ratio` (the second over the first), `eval_avg@8`,
   `eval_pass@8`, `eval_accuracy`.
4. Parity: SmolLM2 in float32 samples 8 held-out prompts (temperature 0.8); the trainer scores each sample's
   completion by its own code path alone, padded and packed with the others (`training.logprob_parity`):
   `logprob_max_abs_alone`, `logprob_max_abs_padded`, `logprob_max_abs_packed`.

A quick run (STREAMRL_BENCH_QUICK=1) uses the CPU demo's decoder (a short warm-up, 4 steps, 32 held-out prompts, one
seed for the updates): its accuracies are not the goal's work. `--part learning|updates|eval|parity` runs one part
(default: all). Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = size(ROOT / "configs" / "smollm2_cpu.gin", ROOT / "configs" / "demo_cpu.gin")
WORK = size((), ("PipelineConfig.steps=4", "JobConfig.warmup_steps=40", "JobConfig.eval_prompts=32"))
RUNS = {"colocated": ("PipelineConfig.mode='colocated'",),
        "async4_corrected": ("PipelineConfig.mode='async'", "PipelineConfig.staleness=4"),
        "async4_uncorrected": ("PipelineConfig.mode='async'", "PipelineConfig.staleness=4",
                               "ObjectiveConfig.correction='none'")}
PARITY_PROMPTS = size(8, 4)
UPDATES = {"m1": (), "m4": ("TrainerConfig.mini_batches=4",), "e2": ("TrainerConfig.epochs=2",)}
SEEDS = size((1, 2, 3), (1,))
EVAL_K = 8
PARTS = ("learning", "updates", "eval", "parity")


def train(name: str, workdir: Path, bindings: tuple[str, ...] | None = None) -> dict:
  """One `streamrl train` of the work as `name` (or `bindings`) sets it: its summary and mean metrics."""
  command = [sys.executable, "-m", "streamrl_jax.cli", "train", "--config", str(CONFIG), "--workdir", str(workdir)]
  for binding in (*WORK, *(RUNS[name] if bindings is None else bindings)):
    command += ["--set", binding]
  print(f"async_learning: {name} ...", file=sys.stderr, flush=True)
  done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT,
                        env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  mean = lambda key: float(f"{np.mean([r[key] for r in rows]):.4g}")  # noqa: E731
  at_k = {k: v for k, v in summary.items() if k.startswith(("heldout_avg@", "heldout_pass@"))}
  return dict(accuracy_before=summary["accuracy_before"], accuracy_after=summary["accuracy_after"], at_k=at_k,
              staleness_mean=mean("staleness_mean"), mismatch_kl=mean("logprob_mismatch_kl"),
              truncated_frac=mean("correction_truncated_token_frac"),
              step_s=float(np.mean([r["step_s"] for r in rows[1:]] or [rows[0]["step_s"]])),
              updates=mean("optimizer_updates"))


def updates(tmp: Path, seeds: tuple[int, ...] = SEEDS, variants: tuple[str, ...] = tuple(UPDATES)) -> dict:
  """Held-out accuracy and step time with one update a step, 4 mini-batches and 2 epochs (`variants` of them; m1
  always), over `seeds`."""
  out, step_s = {"updates_seeds": len(seeds)}, {}
  for name in ("m1", *(v for v in variants if v != "m1")):
    runs = [train(f"{name} seed {seed}", tmp / f"{name}_{seed}",
                  (*UPDATES[name], f"PipelineConfig.seed={seed}", f"JobConfig.eval_k={EVAL_K}")) for seed in seeds]
    for key, value in runs[0]["at_k"].items():  # heldout_avg@8_before -> updates_avg@8_m1_before
      stem, when = (key[:-len("_before")], "before") if key.endswith("_before") else (key, "after")
      out[f"updates_{stem.removeprefix('heldout_')}_{name}_{when}"] = round(value, 4)
    accuracy = [r["accuracy_after"] for r in runs]
    out[f"updates_accuracy_{name}"] = round(float(np.mean(accuracy)), 4)
    out[f"updates_accuracy_{name}_range"] = round(float(np.ptp(accuracy)), 4)
    step_s[name] = float(np.mean([r["step_s"] for r in runs]))
    out[f"updates_step_s_{name}"] = round(step_s[name], 3)
    out[f"updates_optimizer_updates_{name}"] = runs[0]["updates"]
  out["updates_accuracy_before"] = runs[0]["accuracy_before"]
  for name in set(step_s) - {"m1"}:
    out[f"updates_step_ratio_{name}"] = round(step_s[name] / step_s["m1"], 3)
  if "m4" in step_s:
    out["updates_m4_minus_m1"] = round(out["updates_accuracy_m4"] - out["updates_accuracy_m1"], 4)
  return out


def cpu_model() -> str:
  """The CPU's model name (machines of this kind differ)."""
  for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return "unknown"


def parity() -> dict:
  """The sampler's log-probabilities against the trainer's at equal float32 weights, alone, padded and packed."""
  import jax
  from flax import nnx

  from streamrl_jax import gin_config
  from streamrl_jax.meshes import single_device_mesh
  from streamrl_jax.sampling import StreamingSampler, make_engine
  from streamrl_jax.training.logprob_parity import max_abs_gaps
  from streamrl_jax.types import SamplingParams

  os.environ["STREAMRL_PROBE_DTYPE"] = "float32"  # the model computes in float32 on both sides
  gin_config.parse(gin_config.run_files([str(CONFIG)]))
  config, job = gin_config.build_run()
  model, tokenizer, _ = job.load_model()  # (the demo decoder unwarmed: parity needs no learned weights)
  task = job.make_task(tokenizer, "eval")
  graphdef, params = nnx.split(model)
  engine = make_engine(graphdef, model.config, config.sampler.engine, single_device_mesh(jax.devices()[0]))
  sampler = StreamingSampler([engine], params, seed=5)
  rng = np.random.default_rng(7)
  knobs = SamplingParams(temperature=0.8, max_new_tokens=config.max_new_tokens, stop_token_ids=tokenizer.stop_ids)
  for group in range(PARITY_PROMPTS):
    sampler.submit(tokenizer.encode(task.sample(rng)[0]), knobs, group_id=group)
  samples = list(sampler.stream())
  gaps = max_abs_gaps(graphdef, params, samples, 0.8)
  return {f"logprob_max_abs_{layout}": float(f"{gap:.3g}") for layout, gap in gaps.items()}


def at_k_cost() -> dict:
  """The held-out evaluation of the untrained policy, greedy and at k=`EVAL_K`, each timed after a compiling pass."""
  import time

  from streamrl_jax import gin_config
  from streamrl_jax.job.evaluation import held_out_of

  gin_config.parse(gin_config.run_files([str(CONFIG)]), [*WORK, f"JobConfig.eval_k={EVAL_K}"])
  config, job = gin_config.build_run()
  model, tokenizer, _ = job.load_model()  # the demo decoder unwarmed in a quick run: its scores are not the goal's
  held_out = held_out_of(job, tokenizer, job.make_task(tokenizer, "eval"), config.sampler, config.max_new_tokens)
  held_out.scores(model)  # compiles every program both use
  start = time.perf_counter()
  greedy = held_out.accuracy(model)
  greedy_s = time.perf_counter() - start
  start = time.perf_counter()
  scores = held_out.scores(model)
  at_k_s = time.perf_counter() - start - greedy_s  # scores() decodes greedily first, then the k samples
  return {"eval_prompts": job.eval_prompts, "eval_greedy_s": round(greedy_s, 2), f"eval_at_{EVAL_K}_s": round(at_k_s, 2),
          "eval_at_k_cost_ratio": round(at_k_s / greedy_s, 3), "eval_accuracy": greedy,
          **{f"eval_{k.removeprefix('heldout_')}": round(v, 4) for k, v in scores.at_k.items()}}


def main(parts=PARTS, seeds: tuple[int, ...] = SEEDS,
         variants: tuple[str, ...] = tuple(UPDATES)) -> dict:
  out = {"cpu_model": cpu_model()}
  with tempfile.TemporaryDirectory(prefix="async_learning_") as tmp:  # checkpoints: gigabytes
    if "learning" in parts:
      out.update(learning(Path(tmp)))
    if "updates" in parts:
      out.update(updates(Path(tmp), seeds, variants))
  if "eval" in parts:
    print("async_learning: evaluation at k ...", file=sys.stderr, flush=True)
    out.update(at_k_cost())
  if "parity" in parts:
    print("async_learning: parity ...", file=sys.stderr, flush=True)
    out.update(parity())
  return out


def learning(tmp: Path) -> dict:
  """Accuracy after colocated and async runs (`RUNS`), with each run's staleness and mismatch."""
  out, runs = {}, {}
  for name in RUNS:
    runs[name] = train(name, tmp / name)
  out["accuracy_before"] = runs["colocated"]["accuracy_before"]
  for name, run in runs.items():
    out[f"accuracy_{name}"] = run["accuracy_after"]
    out.update({f"{name}_{k}": v for k, v in run.items()
                if k not in ("accuracy_before", "accuracy_after", "step_s", "updates")})
  out["async4_minus_colocated"] = round(out["accuracy_async4_corrected"] - out["accuracy_colocated"], 4)
  out["async4_uncorrected_minus_colocated"] = round(out["accuracy_async4_uncorrected"] - out["accuracy_colocated"], 4)
  return out


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=PARTS, action="append",
                      help="run this part alone (repeatable; default: every part)")
  parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"updates: seeds a variant (default {len(SEEDS)})")
  parser.add_argument("--variant", choices=tuple(UPDATES), action="append",
                      help="updates: this variant beside m1 (repeatable; default: all)")
  args = parser.parse_args()
  print(json.dumps(main(tuple(args.part or PARTS), tuple(range(1, args.seeds + 1)),
                        tuple(args.variant or UPDATES))))
