"""Where a step's seconds go, and how they compare with TRL's at its best, on the equal-work workload (SmolLM2-135M-
Instruct, `configs/smollm2_cpu.gin` at 4 prompts x 8 samples x 32 new tokens, temperature 1, no KL, 6 steps), in
`async` and in `colocated` mode: each mode one `streamrl train` process of its own, its rows' seconds by phase.

The full run alternates TRL, async and colocated three times (a round each) and reports each figure's median over
the rounds with its range (`*_range`): this shared machine's speed drifts between runs minutes apart, so one run
says little. TRL (`trl_grpo.py`, the `[bench]` extra) runs in the first round with gradient checkpointing on (its
default) and off, and with bfloat16 autocast where torch's bfloat16 products beat its float32 ones on this CPU; the
later rounds run its fastest setting. Step ratios are against TRL's fastest, memory against its leanest.

Per mode: the steady step (median gap between rows after the first two: the sum of `trainer_s/<phase>`), the
median seconds of each trainer and sampler phase, `accounted_frac` (the trainer's named phases over its wall step; the sampler's beside
it), `whole_step_mfu` (8 x parameters x trained tokens over the steady step: 6 N to train each token, 2 N to generate
it) and `trainer_mfu` (6 x parameters x trained tokens over the median forward and backward seconds; colocated's,
where the trainer has the machine to itself; async's beside it). Every MFU divides by the peak of the dtype the run
computes in (its settings.json: `compute_dtype='auto'` as this machine resolves it, models/dtype_probe.py), measured
in this process before and after the runs at the model's own product shapes (the goal's: what a model of this size
can reach) and on a 2048 product (`*_of_2048_peak`). A quick run (STREAMRL_BENCH_QUICK=1) profiles the demo decoder
(no warm-up) for 4 steps of 16 new tokens, one round and no TRL: its figures are not the goal's work. Prints one JSON
object as its last line.
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
ROUNDS = size(3, 1)  # TRL, async and colocated alternate this many times
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
  dtype = json.loads((workdir / "settings.json").read_text())["resolved.compute_dtype"]
  parameters = sum(v.size for f in (workdir / "final_model").glob("*.safetensors") for v in load_file(str(f)).values())
  steady = rows[SKIP:]
  median = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
  phases = lambda side: sorted({k.split("/", 1)[1]  # noqa: E731
                                for r in steady for k in r if k.startswith(f"{side}_s/")})
  gap = lambda r: sum(r[f"trainer_s/{p}"] for p in phases("trainer"))  # noqa: E731  (the gap since the last row)
  wall = sum(gap(r) for r in steady)
  trainer_named = sum(gap(r) - r["trainer_s/other"] for r in steady)
  sampler_total = sum(r[f"sampler_s/{p}"] for r in steady for p in phases("sampler"))
  sampler_named = sampler_total - sum(r["sampler_s/other"] for r in steady)
  step = statistics.median(gap(r) for r in steady)
  flops = 8 * parameters * median("train_tokens")
  return dict(step_s=round(step, 2), steps=len(rows), parameters=parameters, compute_dtype=dtype,
              train_tokens=median("train_tokens"),
              accounted_frac=round(trainer_named / wall, 4),
              sampler_accounted_frac=round(sampler_named / max(sampler_total, 1e-9), 4),
              useful_tflop_per_step=round(flops / 1e12, 3), flops_per_s=flops / step,
              trainer_flops_per_s=0.75 * flops / median("trainer_s/forward_backward"),  # 6 N of the 8 N: training
              trainer_s={p: round(median(f"trainer_s/{p}"), 3) for p in phases("trainer")},
              sampler_s={p: round(median(f"sampler_s/{p}"), 3) for p in phases("sampler")},
              peak_rss_mb=done["peak_rss_mb"], peak_at_s=done["peak_at_s"], peak_processes=done["peak_processes"],
              wall_s=done["seconds"])


def trl(*flags: str) -> dict:
  """TRL's GRPOTrainer on the same work (`trl_grpo.py` with `flags`), its own process: its figures and peak memory."""
  from process_memory import run_measured

  done = run_measured([sys.executable, str(ROOT / "benchmarks" / "trl_grpo.py"), "--steps", str(STEPS),
                       "--new-tokens", str(NEW_TOKENS), *flags], cwd=ROOT, env=dict(os.environ, XLA_FLAGS=""))
  if done["returncode"]:
    raise RuntimeError(f"trl {' '.join(flags)}: exit {done['returncode']}\n{done['output'][-3000:]}")
  return {**json.loads(done["output"].strip().splitlines()[-1]), "trl_peak_rss_mb": done["peak_rss_mb"]}


def trl_settings() -> dict[str, tuple[str, ...]]:
  """TRL's settings to try: gradient checkpointing on (its default) and off; with bfloat16 autocast beside them where
  torch's bfloat16 products beat its float32 ones here (an AMX CPU)."""
  settings = {"checkpointing": ("--gradient-checkpointing", "on"),
              "no_checkpointing": ("--gradient-checkpointing", "off")}
  if trl("--torch-bf16-speedup")["torch_bf16_speedup"] > 1.0:
    settings["bf16_checkpointing"] = ("--gradient-checkpointing", "on", "--bf16")
  return settings


class Peaks:
  """The machine's peaks in float32 and bfloat16-into-float32, at the model's product shapes (`dtype_probe.measure`)
  and on a 2048 product (`peak.Peak`): each measured before and after the runs, the larger kept."""

  def __init__(self, shapes):
    from peak import Peak

    import jax.numpy as jnp

    self.shapes, self.model = shapes, {"float32": 0.0, "bfloat16": 0.0}
    self.square = {"float32": Peak(), "bfloat16": Peak(dtype=jnp.bfloat16)}

  def measure(self) -> None:
    from streamrl_jax.models.dtype_probe import measure

    for dtype, flops in zip(("float32", "bfloat16"), measure(self.shapes)):
      self.model[dtype] = max(self.model[dtype], flops)
    for peak in self.square.values():
      peak.measure()

  def mfu(self, flops_per_s: float, dtype: str) -> tuple[float, float]:
    """(at the model's shapes, on a 2048 product) for a run computing in `dtype`."""
    return round(flops_per_s / self.model[dtype], 4), round(self.square[dtype].mfu(flops_per_s), 4)

  def as_dict(self) -> dict:
    return {f"{d}_gflops_at_model_shapes": round(f / 1e9, 1) for d, f in self.model.items()} | {
        f"{d}_gflops_2048": round(p.flops / 1e9, 1) for d, p in self.square.items()}


def model_shapes():
  """The product shapes of the model the runs train: SmolLM2-135M's, or the demo decoder's in a quick run."""
  from streamrl_jax.models.dtype_probe import ProductShapes
  from streamrl_jax.job.config import JobConfig

  if QUICK:
    from streamrl_jax.models import CharTokenizer

    return ProductShapes.of(JobConfig(warmup_steps=0).model_config(CharTokenizer(), "float32"))
  return ProductShapes.of(JobConfig(model="smollm2-135m-instruct").model_spec()[0])


def rounds() -> tuple[list[dict], dict]:
  """ROUNDS of TRL (not in a quick run), async and colocated in turn (the full run's first also colocated over two
  devices); (each round's figures by run name, TRL's settings' first-round figures)."""
  done, trl_first, settings = [], {}, {} if QUICK else trl_settings()
  for round_ in range(ROUNDS):
    figures = {}
    if settings and round_ == 0:
      trl_first = {name: trl(*flags) for name, flags in settings.items()}
    if settings:
      fastest = min(trl_first, key=lambda name: trl_first[name]["trl_step_s"])
      figures["trl"] = trl_first[fastest] if round_ == 0 else trl(*settings[fastest])
    for name, run in RUNS.items():
      if name in MODES or round_ == 0:
        figures[name] = run_mode(*run)
    done.append(figures)
  return done, trl_first


def spread(values: list[float]) -> tuple[float, list[float]]:
  """(median, [min, max]) of a figure over the rounds."""
  return round(statistics.median(values), 3), [round(min(values), 3), round(max(values), 3)]


def summarise(done: list[dict], trl_first: dict, peaks: Peaks) -> dict:
  """The run's figures: per mode its median round (by step) with every round's step; ratios as per-round medians."""
  out = {}
  for mode in RUNS:
    runs = [r[mode] for r in done if mode in r]
    step, out[f"{mode}_step_s_range"] = spread([r["step_s"] for r in runs])
    median_run = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
    flops = median_run.pop("flops_per_s")
    trainer_flops = median_run.pop("trainer_flops_per_s")
    dtype = median_run["compute_dtype"]
    out[f"{mode}_whole_step_mfu"], out[f"{mode}_whole_step_mfu_of_2048_peak"] = peaks.mfu(flops, dtype)
    out[f"{mode}_trainer_mfu"], out[f"{mode}_trainer_mfu_of_2048_peak"] = peaks.mfu(trainer_flops, dtype)
    out.update({f"{mode}_{k}": v for k, v in median_run.items()}, **{f"{mode}_step_s": step})
    out[f"{mode}_peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
  out["compute_dtype"] = out["async_compute_dtype"]
  out["accounted_frac"] = min(out[f"{m}_accounted_frac"] for m in MODES)
  for key in ("whole_step_mfu", "whole_step_mfu_of_2048_peak"):
    out[key] = min(out[f"{m}_{key}"] for m in MODES)
  for key in ("trainer_mfu", "trainer_mfu_of_2048_peak"):  # colocated's: the trainer alone on the machine
    out[key] = out[f"colocated_{key}"]
  out["async_over_colocated"], out["async_over_colocated_range"] = spread(
      [r["async"]["step_s"] / r["colocated"]["step_s"] for r in done])
  if "colocated_two_devices_step_s" in out:
    out["colocated_two_devices_over_one"] = round(out["colocated_two_devices_step_s"] / out["colocated_step_s"], 3)
  if trl_first:
    out.update(_against_trl(done, trl_first, out))
  return out


def _against_trl(done: list[dict], trl_first: dict, out: dict) -> dict:
  """Each mode's step over TRL's fastest (per round, median and range) and its peak memory over TRL's leanest."""
  fastest = min(trl_first, key=lambda name: trl_first[name]["trl_step_s"])
  leanest = min(trl_first, key=lambda name: trl_first[name]["trl_peak_rss_mb"])
  against = {"trl_settings": {name: {k: t[k] for k in ("trl_step_s", "trl_peak_rss_mb", "trl_tokens_per_step")}
                              for name, t in trl_first.items()},
             "trl_fastest": fastest, "trl_leanest": leanest,
             "trl_leanest_peak_rss_mb": trl_first[leanest]["trl_peak_rss_mb"],
             "trl_tokens_per_step": trl_first[fastest]["trl_tokens_per_step"]}
  against["trl_step_s"], against["trl_step_s_range"] = spread([r["trl"]["trl_step_s"] for r in done])
  for mode in MODES:
    against[f"{mode}_over_trl"], against[f"{mode}_over_trl_range"] = spread(
        [r[mode]["step_s"] / r["trl"]["trl_step_s"] for r in done])
    against[f"{mode}_peak_rss_over_trl"] = round(out[f"{mode}_peak_rss_mb"] / against["trl_leanest_peak_rss_mb"], 3)
  return against


def main() -> None:
  peaks = Peaks(model_shapes())
  peaks.measure()
  done, trl_first = rounds()
  peaks.measure()
  out = {"workload": f"{'the demo decoder' if QUICK else 'SmolLM2-135M'}, 4 prompts x 8 samples x {NEW_TOKENS} new "
                     f"tokens, temperature 1, no KL, {STEPS} steps; steady: rows {SKIP + 1}..{STEPS}; {ROUNDS} "
                     "round(s) of TRL, async and colocated in turn", "quick": QUICK, "rounds": ROUNDS,
         **peaks.as_dict(), **summarise(done, trl_first, peaks)}
  if QUICK:  # the full run's parts: TRL on the goal's work, colocated over two devices
    out["quick_omits"] = ["trl_step_s", "colocated_two_devices_over_one",
                          *(f"{m}_{k}" for m in MODES for k in ("over_trl", "peak_rss_over_trl"))]
  print(json.dumps(out))


if __name__ == "__main__":
  main()
