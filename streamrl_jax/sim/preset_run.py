"""`streamrl simulate`: runs a preset's scenarios (`run_preset`) and writes results.json and plots to a directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from streamrl_jax.modes import MODES, ModeSpec
from streamrl_jax.sim.pipeline import SimConfig, simulate, simulate_elastic
from streamrl_jax.sim.preset_names import SCALING, SCALING_MODELS
from streamrl_jax.sim.presets import ablation_ladder, balanced_split, expected_generation_s, preset, scaling_preset
from streamrl_jax.sim.scaling import scaling_results


def figure(**settings):
  """A matplotlib `Figure` of its own (no pyplot: no global figure state)."""
  from matplotlib.figure import Figure

  return Figure(**settings)


PLOTS = ("throughput_by_mode.png", "gantt.png", "generation_normalized.png")
SCALING_PLOTS = ("scaling.png",)


def written(name: str) -> tuple[str, ...]:
  """The files `run_preset(name, ...)` writes."""
  return ("results.json", *(SCALING_PLOTS if name == SCALING else PLOTS))


def run_preset(name: str, out: str | Path, **overrides) -> dict:
  """Ablation ladder, every mode, generation time by dispatch policy, and the balanced split; for `distflow-scaling`,
  the data plane's sweep (`run_scaling`)."""
  if name == SCALING:
    return run_scaling(out, seed=overrides.get("seed", 0))
  config = preset(name, **overrides)
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  ladder = ablation_ladder(config)
  modes = {m: simulate(dataclasses.replace(config, mode=m, dispatch="skew_aware",
                                           sampler_devices=ladder["sampler_devices"])) for m in MODES}
  generation = {d: expected_generation_s(dataclasses.replace(config, dispatch=d), ladder["sampler_devices"])
                for d in ("random", "skew_aware", "oracle")}
  sampler, trainer = balanced_split(dataclasses.replace(config, dispatch="skew_aware"))
  results = {
      "preset": name,
      "normalized_throughput": ladder["normalized_throughput"],
      "samples_per_s_by_mode": {m: round(r["samples_per_s"], 4) for m, r in modes.items()},
      "samples_per_cost_unit_by_mode": {m: round(r["samples_per_s"] * 3600 / _cost_per_hour(config, m, ladder),
                                                 3) for m, r in modes.items()},
      "generation_s_normalized_to_random": {d: round(t / generation["random"], 4) for d, t in generation.items()},
      "balanced_split": {"sampler_devices": sampler, "trainer_devices": trainer,
                         "total_devices": config.total_devices},
      "config": _settings(config),
  }
  drifting = dataclasses.replace(config, mode="disaggregated", dispatch="random",
                                 batch=dataclasses.replace(config.batch, length_drift=0.15),
                                 iterations=max(6, config.iterations), sampler_devices=sampler)
  results["elastic"] = simulate_elastic(drifting)
  (out / "results.json").write_text(json.dumps(results, indent=2))
  _plots(out, results, modes["async"]["timeline"], ladder["runs"]["colocated"]["timeline"])
  return results


def run_scaling(out: str | Path, seed: int = 0) -> dict:
  """`distflow-scaling`: per-device throughput of both data-plane designs, 8 to 1,024 trainer devices, for each of
  its models; writes results.json and scaling.png."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  results = {"preset": SCALING, **scaling_results({m: scaling_preset(m) for m in SCALING_MODELS}, seed)}
  (out / "results.json").write_text(json.dumps(results, indent=2))
  _scaling_plot(out, results)
  return results


def _scaling_plot(out: Path, results: dict) -> None:
  fig = figure(figsize=(7, 4))
  ax = fig.subplots()
  for (key, model), color in zip(results["models"].items(), ("#59c", "#c73")):
    for design, style in (("per_process", "-o"), ("central", "--s")):
      ax.plot(results["devices"], model[design]["normalized"], style, color=color, label=f"{key}, {design}")
      ax.plot(results["devices"][-1:] + model["beyond"]["devices"], model[design]["normalized"][-1:]
              + model["beyond"][design], style[:-1], color=color, alpha=0.4)
  ax.axvline(results["devices"][-1], color="#888", lw=0.8)
  ax.text(results["devices"][-1] * 1.2, 0.05, "beyond: version loop left out", fontsize=8, color="#666")
  ax.set_ylim(0, 1.05)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("trainer devices")
  ax.set_ylabel("samples/s per device / at 8 devices")
  ax.set_title(f"{results['preset']}: weak scaling of the trainer's data plane")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "scaling.png", dpi=120)


def _settings(config: SimConfig) -> dict:
  """The config for results.json: numbers and strings as they are, its parts (batch, sampler, trainer, sync) as
  objects of their own, anything else as its text."""
  plain = lambda v: v if isinstance(v, (int, float, str)) else str(v)  # noqa: E731
  parts = ("batch", "sampler", "trainer", "sync", "data_plane")
  return {k: {f: plain(x) for f, x in v.items()} if k in parts else plain(v)
          for k, v in dataclasses.asdict(config).items()}


def _cost_per_hour(config: SimConfig, mode: str, ladder: dict) -> float:
  """Relative cost per hour of the devices a mode holds (H20 = 1.00, H800 = 2.85)."""
  if ModeSpec.of(mode, config.staleness).shared_mesh:
    return config.total_devices * config.trainer.hardware.cost_per_hour
  sampler = ladder["sampler_devices"]
  return (sampler * config.sampler.hardware.cost_per_hour
          + (config.total_devices - sampler) * config.trainer.hardware.cost_per_hour)


def _plots(out: Path, results: dict, async_timeline: dict, colocated_timeline: dict) -> None:
  fig = figure(figsize=(6, 3.5))
  ax = fig.subplots()
  ladder = results["normalized_throughput"]
  ax.bar(list(ladder), list(ladder.values()), color=["#888", "#6a9", "#59c", "#c73"])
  ax.set_ylabel("throughput / colocated")
  ax.set_title(f"{results['preset']}: ablation ladder")
  for i, v in enumerate(ladder.values()):
    ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
  fig.tight_layout()
  fig.savefig(out / "throughput_by_mode.png", dpi=120)

  fig = figure(figsize=(8, 6))
  axes = fig.subplots(2, 1, sharex=True)
  fig.suptitle("first iteration: instances (long-tail orange), trainer (green), weight sync (purple)")
  for ax, (title, tl) in zip(axes, [("colocated, random dispatch", colocated_timeline),
                                    ("async, skew-aware dispatch", async_timeline)]):
    for i, (start, end) in enumerate(tl["instances"]):
      ax.barh(i, end - start, left=start, color="#c73" if i < tl["long_instances"] else "#59c")
    row = len(tl["instances"])
    for start, end in tl["trainer"]:
      ax.barh(row, end - start, left=start, color="#6a9")
    if tl["sync"]:
      ax.barh(row + 1, tl["sync"][1] - tl["sync"][0], left=tl["sync"][0], color="#a5a")
    ax.set_title(title)
    ax.set_ylabel("instance")
  axes[-1].set_xlabel("seconds in the first iteration")
  fig.tight_layout()
  fig.savefig(out / "gantt.png", dpi=120)

  fig = figure(figsize=(5, 3.5))
  ax = fig.subplots()
  gen = results["generation_s_normalized_to_random"]
  ax.bar(list(gen), list(gen.values()), color=["#888", "#59c", "#6a9"])
  ax.set_ylabel("generation time / random+FIFO")
  ax.set_ylim(0, max(1.1, max(gen.values()) * 1.1))
  fig.tight_layout()
  fig.savefig(out / "generation_normalized.png", dpi=120)


def summary_lines(results: dict) -> list[str]:
  if results["preset"] == SCALING:
    return _scaling_lines(results)
  split = results["balanced_split"]
  return [f"preset {results['preset']}",
          "normalized throughput: " + ", ".join(f"{k} {v:.2f}" for k, v in results["normalized_throughput"].items()),
          "generation time / random: " + ", ".join(f"{k} {v:.2f}"
                                                   for k, v in results["generation_s_normalized_to_random"].items()),
          f"balanced split: {split['sampler_devices']} sampler / {split['trainer_devices']} trainer devices "
          f"of {split['total_devices']}"]



def _scaling_lines(results: dict) -> list[str]:
  last = results["devices"][-1]
  def figures(design):
    by_model = results[f"{design}_scaling_{last}_by_model"]
    return f"{results[f'{design}_scaling_{last}']:.3f} (" + ", ".join(f"{k} {v:.3f}" for k, v in by_model.items()) + ")"
  saturation = results["central_saturation_devices_by_model"]
  return [f"preset {results['preset']}",
          f"samples/s per trainer device at {last} devices over at {results['devices'][0]}: "
          f"per_process {figures('per_process')}, central {figures('central')}",
          "central: process 0 bounds the iteration from " + ", ".join(
              f"{v} devices ({k})" if v else f"beyond the search ({k})" for k, v in saturation.items())]
