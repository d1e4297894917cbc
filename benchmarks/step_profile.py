"""Where a step's seconds go, on the equal-work workload that TRL is held against (SmolLM2-135M-Instruct,
`configs/smollm2_cpu.gin` at 4 prompts x 8 samples x 32 new tokens, temperature 1, no KL, 6 steps), in `async`
and in `colocated` mode: each mode one `streamrl train` process of its own, its rows' seconds by phase.

Per mode: the steady step (median gap between rows after the first two, `step_wall_s`), the median seconds of
each trainer and sampler phase over those rows, `accounted_frac` (the trainer's named phases over its wall
step, summed over the steady rows; the sampler's beside it), `whole_step_mfu` (the step's useful FLOPs,
8 x parameters x trained tokens: 6 N to train each token, 2 N to generate it, over the steady step times the f32
matmul peak measured in this process before and after the runs; N counted in the run's final model), `trainer_mfu`
(6 x parameters x trained tokens over the median forward and backward seconds, against the same peak: colocated's,
where the trainer has the machine to itself; async's, which shares the cores with its sampler, beside it); both also
over the bfloat16 matmul peak (`*_of_bf16_peak`, the one to read for a run computing in bfloat16), and the run's peak
resident memory (its processes summed; `peak_at_s` and `peak_processes` say when, and which process held what). The
full run profiles colocated once more over two CPU devices, the rule before one device
(`colocated_two_devices_over_one`), and TRL's GRPOTrainer on the same work (`trl_grpo.py`, with the `[bench]` extra):
each mode's step and peak memory over TRL's. A quick run (STREAMRL_BENCH_QUICK=1) profiles the demo decoder (no
warm-up) for 4 steps of 16 new tokens: its figures are not the goal's work. Prints one JSON object as its last line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, by module name
from sizing import QUICK, size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_cpu.gin"
STEPS, NEW_TOKENS = size(6, 4), size(32, 16)
MODEL = size(("--config", str(CONFIG)), ("--set", "JobConfig.warmup_steps=0"))  # quick: the demo decoder
SKIP = 2  # rows left out of the steady figures: the first compiles, the second may wait on it
WORK = ("PipelineConfig.prompts_per_step=4", "PipelineConfig.group_size=8",
        f"PipelineConfig.max_new_tokens={NEW_TOKENS}",
        "PipelineConfig.temperature=1.0", "ObjectiveConfig.kl_coef=0.0", f"PipelineConfig.steps={STEPS}",
        "JobConfig.eval_prompts=1")
MODES = ("async", "colocated")
# Runs by name: (mode, CPU devices forced; None: streamrl's own choice). The baseline of the colocated choice (one
# device, `meshes.cpu_device_count`) is its mesh over two devices, the rule before; the full run only.
RUNS = {"async": ("async", None), "colocated": ("colocated", None),
        **size({"colocated_two_devices": ("colocated", 2)}, {})}


def run_mode(mode: str, host_devices: int | None = None) -> dict:
  """One `streamrl train` of the workload in `mode` (over `host_devices` CPU devices if given): its steady figures."""
  with tempfile.TemporaryDirectory(prefix=f"step_profile_{mode}_") as tmp:  # a run's checkpoints: gigabytes
    return _profile(mode, Path(tmp), host_devices)


def _profile(mode: str, workdir: Path, host_devices: int | None) -> dict:
  from process_memory import run_measured
  from safetensors.numpy import load_file

  sets = [a for s in (*WORK, f"PipelineConfig.mode='{mode}'") for a in ("--set", s)]
  devices = [] if host_devices is None else ["--host-devices", str(host_devices)]
  done = run_measured([sys.executable, "-m", "streamrl_jax.cli", *devices, "train", *MODEL, "--workdir", str(workdir),
                       *sets], cwd=ROOT, env=dict(os.environ, XLA_FLAGS=""))
  if done["returncode"]:
    raise RuntimeError(f"{mode}: exit {done['returncode']}\n{done['output'][-3000:]}")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  parameters = sum(v.size for f in (workdir / "final_model").glob("*.safetensors") for v in load_file(str(f)).values())
  steady = rows[SKIP:]
  median = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
  phases = lambda side: sorted({k.split("/", 1)[1]  # noqa: E731
                                for r in steady for k in r if k.startswith(f"{side}_s/")})
  wall = sum(r["step_wall_s"] for r in steady)
  trainer_named = sum(r["step_wall_s"] - r["trainer_s/other"] for r in steady)
  sampler_total = sum(r[f"sampler_s/{p}"] for r in steady for p in phases("sampler"))
  sampler_named = sampler_total - sum(r["sampler_s/other"] for r in steady)
  step = median("step_wall_s")
  flops = 8 * parameters * median("train_tokens")
  return dict(step_s=round(step, 2), steps=len(rows), parameters=parameters,
              accounted_frac=round(trainer_named / wall, 4),
              sampler_accounted_frac=round(sampler_named / max(sampler_total, 1e-9), 4),
              useful_tflop_per_step=round(flops / 1e12, 3), flops_per_s=flops / step,
              trainer_flops_per_s=0.75 * flops / median("trainer_s/forward_backward"),  # 6 N of the 8 N: training
              trainer_s={p: round(median(f"trainer_s/{p}"), 3) for p in phases("trainer")},
              sampler_s={p: round(median(f"sampler_s/{p}"), 3) for p in phases("sampler")},
              peak_rss_mb=done["peak_rss_mb"], peak_at_s=done["peak_at_s"], peak_processes=done["peak_processes"],
              wall_s=done["seconds"])


def run_trl() -> dict:
  """TRL's GRPOTrainer on the same work (`trl_grpo.py`, the `[bench]` extra), as its own process: its step and peak
  memory; without trl installed, why not."""
  import importlib.util

  from process_memory import run_measured

  if importlib.util.find_spec("trl") is None:
    return {"trl": "not measured: trl is not installed (pip install -e '.[bench]')"}
  done = run_measured([sys.executable, str(ROOT / "benchmarks" / "trl_grpo.py"), "--steps", str(STEPS),
                       "--new-tokens", str(NEW_TOKENS)], cwd=ROOT, env=dict(os.environ, XLA_FLAGS=""))
  if done["returncode"]:
    raise RuntimeError(f"trl: exit {done['returncode']}\n{done['output'][-3000:]}")
  return {**json.loads(done["output"].strip().splitlines()[-1]), "trl_peak_rss_mb": done["peak_rss_mb"]}


def main() -> None:
  from peak import Peak

  import jax.numpy as jnp

  peak, bf16_peak = Peak(), Peak(dtype=jnp.bfloat16)  # a run in bfloat16 is judged against its own peak
  peak.measure()
  bf16_peak.measure()
  modes = {name: run_mode(*run) for name, run in RUNS.items()}
  trl = {} if QUICK else run_trl()  # a quick run's work is the demo decoder's: no baseline to hold it against
  peak.measure()
  bf16_peak.measure()
  out = {"workload": f"{'the demo decoder' if QUICK else 'SmolLM2-135M'}, 4 prompts x 8 samples x {NEW_TOKENS} new "
                     f"tokens, temperature 1, no KL, {STEPS} steps; steady: rows {SKIP + 1}..{STEPS}", "quick": QUICK,
         "peak_gflops": round(peak.flops / 1e9, 1), "bf16_peak_gflops": round(bf16_peak.flops / 1e9, 1)}
  for mode, figures in modes.items():
    figures["whole_step_mfu_of_bf16_peak"] = round(bf16_peak.mfu(figures["flops_per_s"]), 4)
    figures["whole_step_mfu"] = round(peak.mfu(figures.pop("flops_per_s")), 4)
    figures["trainer_mfu_of_bf16_peak"] = round(bf16_peak.mfu(figures["trainer_flops_per_s"]), 4)
    figures["trainer_mfu"] = round(peak.mfu(figures.pop("trainer_flops_per_s")), 4)
    out.update({f"{mode}_{k}": v for k, v in figures.items()})
  out["accounted_frac"] = min(out[f"{m}_accounted_frac"] for m in MODES)
  out["whole_step_mfu"] = min(out[f"{m}_whole_step_mfu"] for m in MODES)
  out["trainer_mfu"] = out["colocated_trainer_mfu"]  # async's trainer shares the cores with its sampler's work
  out["whole_step_mfu_of_bf16_peak"] = min(out[f"{m}_whole_step_mfu_of_bf16_peak"] for m in MODES)
  out["trainer_mfu_of_bf16_peak"] = out["colocated_trainer_mfu_of_bf16_peak"]
  out["colocated_over_async"] = round(out["colocated_step_s"] / out["async_step_s"], 3)
  out.update(trl)
  if "trl_step_s" in trl:
    for mode in MODES:
      out[f"{mode}_over_trl"] = round(out[f"{mode}_step_s"] / trl["trl_step_s"], 3)
      out[f"{mode}_peak_rss_over_trl"] = round(out[f"{mode}_peak_rss_mb"] / trl["trl_peak_rss_mb"], 3)
  if QUICK:  # the full run's parts: TRL on the goal's work, colocated over two devices
    out["quick_omits"] = ["trl_step_s", "colocated_two_devices_over_one",
                          *(f"{m}_{k}" for m in MODES for k in ("over_trl", "peak_rss_over_trl"))]
  if "colocated_two_devices" in modes:
    out["colocated_two_devices_over_one"] = round(out["colocated_two_devices_step_s"] / out["colocated_step_s"], 3)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
