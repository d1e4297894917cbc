"""Pictures of a run: the busy/idle timeline as PNG, and a Chrome-trace JSON for Perfetto."""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {"sampler": "#59c", "trainer": "#6a9", "sync": "#a5a"}


def write_timeline_png(timeline: dict, path: str | Path, title: str = "") -> None:
  """One row per component; bars where it was busy, gaps where it idled; weight syncs as ticks."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 2.6))
  rows = list(timeline)
  for y, name in enumerate(rows):
    for start, end, _ in timeline[name]:
      if name == "sync":
        ax.axvline(start, color=COLORS[name], linewidth=1)
      else:
        ax.barh(y, max(end - start, 1e-3), left=start, color=COLORS.get(name, "#888"))
  ax.set_yticks(range(len(rows)), rows)
  ax.set_xlabel("seconds")
  ax.set_title(title or "busy intervals (weight syncs as vertical lines)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_chrome_trace(timeline: dict, path: str | Path) -> None:
  """Complete events ("ph": "X") in microseconds, one thread per component."""
  events = []
  for tid, (name, spans) in enumerate(timeline.items()):
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
    for start, end, label in spans:
      events.append({"name": label, "ph": "X", "pid": 0, "tid": tid, "ts": start * 1e6,
                     "dur": max(end - start, 0.0) * 1e6})
  Path(path).write_text(json.dumps({"traceEvents": events}))
