"""Pictures of a run: the learning curves and the busy/idle timeline as PNG, and a Chrome-trace JSON for
Perfetto."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl_jax.records.metrics_log import evaluations, read_metrics, sampled_evaluations
from streamrl_jax.records.run_files import read_at_k_before
from streamrl_jax.records.run_record import whole_timeline

COLORS = {"sampler": "#59c", "trainer": "#6a9", "sync": "#a5a", "resume": "#d62"}
MARKS = ("sync", "resume")  # lanes drawn as vertical lines across the others
FEW_POINTS = 5  # a curve's series with fewer points is drawn as labelled points, not a line (`_series`)


def figure(**settings):
  """A matplotlib `Figure` of its own, drawn by Agg when saved: no pyplot, so no global figure state shared with the
  threads of a run or a notebook's, and a lighter import."""
  from matplotlib.figure import Figure

  return Figure(**settings)


def write_timeline_png(timeline: dict, path: str | Path, title: str = "") -> None:
  """One row per component; bars where it was busy, gaps where it idled; weight syncs (and resumes) as vertical
  lines; a legend says which is which."""
  from matplotlib.lines import Line2D
  from matplotlib.patches import Patch

  fig = figure(figsize=(9, 2.8))
  ax = fig.subplots()
  rows = [name for name in timeline if name not in MARKS]
  for y, name in enumerate(rows):
    for start, end, _ in timeline[name]:
      ax.barh(y, max(end - start, 1e-3), left=start, color=_color(name))
  for name in MARKS:
    for start, _, _ in timeline.get(name, ()):
      ax.axvline(start, color=COLORS[name], linewidth=1.5 if name == "resume" else 1,
                 linestyle="--" if name == "resume" else "-")
  ax.set_yticks(range(len(rows)), rows)
  ax.set_xlabel("seconds (of RL steps; a resumed run's segments end to end)")
  ax.set_title(title or "when each part was busy")
  kinds = sorted({_kind(name) for name in rows})
  handles = [Patch(color=_color(k), label=f"{k} busy") for k in kinds]
  handles += [Line2D([], [], color=COLORS[m], linestyle="--" if m == "resume" else "-",
                     label="weight sync" if m == "sync" else "resumed") for m in MARKS if timeline.get(m)]
  ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(handles), frameon=False,
            fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _kind(lane: str) -> str:
  """"sampler-1" -> "sampler": the part a lane belongs to."""
  return next((k for k in COLORS if lane.startswith(k)), lane)


def _color(lane: str) -> str:
  return COLORS.get(_kind(lane), "#888")


def write_curves_png(metrics: list[dict], evaluations: list[tuple[int, float]], path: str | Path,
                     title: str = "", sampled: dict[str, list[tuple[int, float]]] | None = None) -> None:
  """`curves_figure` as a PNG."""
  curves_figure(metrics, evaluations, title, sampled).savefig(path, dpi=100)


def curves_figure(metrics: list[dict], evaluations: list[tuple[int, float]], title: str = "",
                  sampled: dict[str, list[tuple[int, float]]] | None = None):
  """The learning curves: reward mean per step (a moving average, and each reward function's mean where a run has
  several: `reward/<name>`), held-out accuracy at each evaluation (step 0: before RL) with avg@k and pass@k where
  `sampled` holds them (`metrics_log.sampled_evaluations`), and the policy loss with the
  KL to the reference policy where the objective has one; whole RL steps on the x axis. A series of fewer than
  `FEW_POINTS` (5) points is drawn as labelled points with no line joining them (see `_series`)."""
  from matplotlib.ticker import MaxNLocator

  fig = figure(figsize=(8, 7.5), layout="constrained")
  top, middle, bottom = fig.subplots(3, 1, sharex=True)
  steps = [m["step"] for m in metrics]
  rewards = [m["reward_mean"] for m in metrics]
  _series(top, steps, rewards, color="#9bd", linewidth=1, label="reward mean per step")
  if len(rewards) >= FEW_POINTS:
    width = max(2, len(rewards) // 10)
    smooth = [sum(rewards[max(0, i - width + 1):i + 1]) / len(rewards[max(0, i - width + 1):i + 1])
              for i in range(len(rewards))]
    top.plot(steps, smooth, color="#26a", linewidth=2, label=f"moving average of {width} steps")
  functions = sorted({k for m in metrics for k in m if k.startswith("reward/")})
  for key in functions if len(functions) > 1 else ():
    _series(top, *zip(*[(m["step"], m[key]) for m in metrics if key in m]), linewidth=1, linestyle=":",
            label=key.split("/", 1)[1])
  top.set_ylabel("reward")
  top.legend(loc="lower right", fontsize=8)
  _evaluations_axis(middle, evaluations, sampled or {})
  drawn = []
  for key, color, label in (("loss", "#555", "policy loss"), ("kl", "#7a4", "KL to the reference policy")):
    rows = [(m["step"], m[key]) for m in metrics if key in m]
    if rows and (key == "loss" or any(value for _, value in rows)):
      _series(bottom, *zip(*rows), color=color, linewidth=1, label=label)
      drawn.append(key)
  bottom.set_ylabel(" / ".join({"loss": "loss", "kl": "KL"}[k] for k in drawn) or "loss")
  bottom.set_xlabel("RL step")
  bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
  for ax in (middle, bottom):
    if ax.get_legend_handles_labels()[0]:
      ax.legend(loc="upper left" if ax is middle else "upper right", fontsize=8)
  top.set_title(title or "learning curves")
  return fig


def _evaluations_axis(ax, evaluations: list[tuple[int, float]], sampled: dict[str, list[tuple[int, float]]]) -> None:
  """The held-out greedy accuracy's points on `ax`, and avg@k's and pass@k's dashed beside them."""
  if evaluations:
    xs, ys = zip(*sorted(evaluations))
    _series(ax, xs, ys, "{:.3f}", always=True, marker="o", color="#c53", label="held-out accuracy (greedy)")
  for (key, points), color in zip(sorted(sampled.items()), ("#e92", "#83b")):
    if points:
      xs, ys = zip(*sorted(points))
      _series(ax, xs, ys, "{:.3f}", always=True, marker="s", linestyle="--", color=color,
              label=f"held-out {key.removeprefix('heldout_')}")
  ax.set_ylabel("accuracy")
  ax.set_ylim(-0.05, 1.1)


def _series(ax, xs, ys, fmt: str = "{:.3g}", always: bool = False, **style):
  """One series on `ax`, returned as its Line2D. Fewer than `FEW_POINTS` points: markers alone (linestyle "None", no
  line that would read as a curve), each labelled with its value. More: as `style` says (a line, with markers where
  it names them), its values labelled only if `always`."""
  xs, ys = list(xs), list(ys)
  few = len(xs) < FEW_POINTS
  if few:
    style = {k: v for k, v in style.items() if k not in ("linestyle", "linewidth")}
    style = dict(style, linestyle="None", marker=style.get("marker", "o"))
  (line,) = ax.plot(xs, ys, **style)
  if few:
    ax.margins(y=0.15)  # room above the highest point for its label
  for x, y in zip(xs, ys) if few or always else ():
    ax.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
  return line


def write_chrome_trace(timeline: dict, path: str | Path) -> None:
  """Complete events ("ph": "X") in microseconds, one thread per component."""
  events = []
  for tid, (name, spans) in enumerate(timeline.items()):
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
    for start, end, label in spans:
      events.append({"name": label, "ph": "X", "pid": 0, "tid": tid, "ts": start * 1e6,
                     "dur": max(end - start, 0.0) * 1e6})
  Path(path).write_text(json.dumps({"traceEvents": events}))


def write_run_curves(workdir: Path, mode: str, steps: int, before: float, after: float | None = None,
                     after_at_k: dict[str, float] | None = None) -> None:
  """WORKDIR/curves.png from metrics.jsonl and the held-out evaluations (before RL at step 0, every
  `JobConfig.eval_every` steps, after at the end, with their scores at k) of a run of `steps` steps in `mode`."""
  metrics = read_metrics(workdir)
  sampled = sampled_evaluations(metrics, read_at_k_before(workdir), after_at_k or {}, steps)
  write_curves_png(metrics, evaluations(metrics, before, after, steps), Path(workdir) / "curves.png",
                   title=f"mode {mode}, {steps} steps", sampled=sampled)


def write_run_pictures(workdir: Path, mode: str, steps: int, before: float, segments: list[dict],
                       after: float | None = None, after_at_k: dict[str, float] | None = None) -> None:
  """curves.png, timeline.png and trace.json of the run so far, every segment of it (`run_record`)."""
  write_run_curves(workdir, mode, steps, before, after, after_at_k)
  timeline = whole_timeline(segments)
  write_timeline_png(timeline, Path(workdir) / "timeline.png", title=f"mode {mode}")
  write_chrome_trace(timeline, Path(workdir) / "trace.json")
