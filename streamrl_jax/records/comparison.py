"""The comparison of a run's arms (`streamrl compare RUN_DIR`): each arm's rows, settings and evaluations read
from the run directory, one table, and one PNG of reward, policy divergence and held-out accuracy over steps.

All arms train on the same samples, drawn by the lead's policy: their per-step rewards are the stream's, equal
wherever both trained the step. What tells arms apart is where their own policies went: the held-out accuracy
of each (greedy, its own weights) and how far each moved from the sampling policy (`arm_policy_divergence`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from streamrl_jax.records.metrics_log import evaluations, read_metrics
from streamrl_jax.records.pictures import figure
from streamrl_jax.records.run_files import ARM_FILE, SUMMARY_FILE, read_accuracy_before
from streamrl_jax.records.run_record import ARMS_DIR

TAIL = 5  # steps averaged for the table's "last" figures


@dataclasses.dataclass(frozen=True)
class ArmRecord:
  name: str
  settings: dict  # arm.json: advantage, objective, learning rate
  rows: list
  accuracy_before: float | None
  accuracy_after: float | None  # None: the run has not finished (no summary.json yet)

  @property
  def skipped(self) -> int:
    return int(self.rows[-1].get("arm_steps_skipped", 0)) if self.rows else 0

  def tail(self, key: str) -> float:
    values = [r[key] for r in self.rows[-TAIL:] if key in r]
    return sum(values) / len(values) if values else math.nan


def read_arms(run_dir: Path) -> list[ArmRecord]:
  """The lead (the run directory's own outputs) then each follower under RUN_DIR/arms, by name; raises naming
  the directory when it holds no run."""
  run_dir = Path(run_dir)
  if not (run_dir / "metrics.jsonl").exists():
    raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run's workdir, or no step trained yet)")
  before = read_accuracy_before(run_dir)
  lead_rows = read_metrics(run_dir)
  lead = _record(run_dir, lead_rows[0].get("arm", "lead") if lead_rows else "lead", lead_rows, before)
  followers = sorted((p for p in (run_dir / ARMS_DIR).glob("*") if p.is_dir()), key=lambda p: p.name)
  return [lead] + [_record(p, p.name, read_metrics(p), before) for p in followers]


def _record(directory: Path, name: str, rows: list, before: float | None) -> ArmRecord:
  summary = _read_json(directory / SUMMARY_FILE)
  return ArmRecord(name, _read_json(directory / ARM_FILE), rows, before, summary.get("accuracy_after"))


def _read_json(path: Path) -> dict:
  return json.loads(path.read_text()) if path.exists() else {}


def table(arms: list[ArmRecord]) -> str:
  """One line per arm: its settings, steps trained and skipped, the last steps' divergence, held-out accuracy."""
  head = ("arm", "advantage", "objective", "lr", "trained", "skipped", f"divergence(last {TAIL})", "acc before",
          "acc after", "change")
  lines = [head]
  for arm in arms:
    s, after, before = arm.settings, arm.accuracy_after, arm.accuracy_before
    lines.append((arm.name, s.get("advantage", "?"), s.get("objective", "?"), _num(s.get("learning_rate")),
                  str(len(arm.rows)), str(arm.skipped), _num(arm.tail("arm_policy_divergence")), _num(before),
                  _num(after), f"{after - before:+.3f}" if after is not None and before is not None else "-"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _num(value) -> str:
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "-"
  if isinstance(value, float):
    return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.3f}"
  return str(value)


def write_comparison_png(arms: list[ArmRecord], path: Path, steps: int | None = None) -> None:
  """Three panels over RL steps, a colour per arm: the reward of the samples each trained on, its policy's
  divergence from the sampling policy, and its held-out accuracy (before RL, every `JobConfig.eval_every` steps,
  after)."""
  fig = figure(figsize=(8, 8))
  reward, divergence, accuracy = fig.subplots(3, 1, sharex=True)
  last = steps or max((arm.rows[-1]["step"] for arm in arms if arm.rows), default=1)
  for i, arm in enumerate(arms):
    color = f"C{i}"
    label = f"{arm.name} ({arm.settings.get('advantage', '?')}, {arm.settings.get('objective', '?')})"
    xs = [r["step"] for r in arm.rows]
    reward.plot(xs, [r["reward_mean"] for r in arm.rows], color=color, linewidth=1.2, label=label,
                linestyle="-" if i == 0 else "--", marker="." if len(xs) < 30 else None)
    divergence.plot(xs, [r.get("arm_policy_divergence", math.nan) for r in arm.rows], color=color, linewidth=1.2)
    points = evaluations(arm.rows, arm.accuracy_before, arm.accuracy_after, last)
    if points:
      accuracy.plot(*zip(*points), color=color, marker="o", linewidth=1.2)
      x, y = points[-1]
      accuracy.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(8, 11 * i - 8), fontsize=8,
                        color=color)
  reward.set_ylabel("reward of the\nshared samples")
  reward.legend(loc="lower right", fontsize=8)
  divergence.set_ylabel("KL to the sampler\n(per token)")
  accuracy.set_ylabel("held-out accuracy\n(greedy)")
  accuracy.set_ylim(-0.05, 1.05)
  accuracy.set_xlabel("RL step")
  reward.set_title("arms on one sample stream")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
