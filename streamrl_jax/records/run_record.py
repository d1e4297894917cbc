"""A run's record across its segments, so that a resumed run reads as one run: WORKDIR/run.json lists each
segment (the first start, then each resume) with the steps it began and ended at, its wall seconds, its timeline
and its counters. The summary's wall time, resume count and counters, and the whole run's timeline, are computed
from it.

Plain data and pure functions, and `RunRecord`, which holds the record of the running segment and writes it at
each change (one thread: the trainer's); the file is replaced whole, so a kill mid-write leaves the previous one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RECORD_FILE = "run.json"
RUN_ID_FILE = "run_id"
ARMS_DIR = "arms"  # WORKDIR/arms/NAME: each follower arm's outputs


def run_id(workdir: Path) -> str:
  """The run's id: made at its first start (WORKDIR/run_id), the same on every resume. A follower arm's program
  keeps the id of the run it joined beside its checkpoints, and a lead refuses one of another run."""
  path = Path(workdir) / RUN_ID_FILE
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(os.urandom(8).hex())
  return path.read_text().strip()


def write_run_id(directory: Path, value: str) -> None:
  """Keeps the id of the run a follower arm's program joined (WORKDIR/run_id of its own workdir)."""
  (Path(directory) / RUN_ID_FILE).write_text(value)


def begin(workdir: Path, resumed_at: int | None) -> list[dict]:
  """The segments of a run that starts now: none before it on a fresh start; on a resume from the checkpoint of
  step `resumed_at`, those on record before it (none for a workdir written before this record existed)."""
  path = Path(workdir) / RECORD_FILE
  before = json.loads(path.read_text())["segments"] if resumed_at is not None and path.exists() else []
  start = resumed_at or 0
  return before + [dict(first_step=start, last_step=start, seconds=0.0, timeline=None, counters=None)]


def stepped(segments: list[dict], step: int, seconds: float) -> list[dict]:
  """The record after the current segment trained `step`, `seconds` after it began."""
  return segments[:-1] + [dict(segments[-1], last_step=step, seconds=seconds)]


def ended(segments: list[dict], timeline: dict, counters: dict, seconds: float, arm_counters: dict | None = None
          ) -> list[dict]:
  """The record once the current segment's RL steps ended (done, stopped or failed), with its timeline, counters and
  its follower arms' counters (by arm name; none without arms)."""
  extra = {"arm_counters": arm_counters} if arm_counters else {}
  return segments[:-1] + [dict(segments[-1], timeline=timeline, counters=counters, **extra,
                               seconds=max(seconds, segments[-1]["seconds"]))]


def save(workdir: Path, segments: list[dict]) -> None:
  path = Path(workdir) / RECORD_FILE
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps({"segments": segments}))
  os.replace(tmp, path)


# Counters that are a level or a size, not a count of events: the latest segment's value stands for the run; and
# those that are the most of something: the largest.
LEVELS = ("weight_version_bytes", "queue_depth", "queue_closed")
MOSTS = ("queue_max_depth",)


def totals(segments: list[dict]) -> dict:
  """{"rl_seconds": the segments' wall seconds summed, "resumes": how often the run was resumed, "counters": the
  segments' counters as one run's (`merged_counters`), "counted_segments": how many segments they come from (a
  segment killed before its steps ended left none)}."""
  counted = [s["counters"] for s in segments if s.get("counters") is not None]
  return dict(rl_seconds=sum(s["seconds"] for s in segments), resumes=len(segments) - 1,
              counters=merged_counters(counted), counted_segments=len(counted))


def arm_totals(segments: list[dict]) -> dict[str, dict]:
  """{follower arm: its counters over every segment that ended, as one run's} (`merged_counters`)."""
  names = sorted({name for s in segments for name in s.get("arm_counters") or {}})
  return {name: merged_counters([s["arm_counters"][name] for s in segments if name in (s.get("arm_counters") or {})])
          for name in names}


def merged_counters(parts: list[dict]) -> dict:
  """Counters of consecutive segments as one run's: counts and seconds summed, a most (`MOSTS`) the largest, a
  level (`LEVELS`) and a flag the latest."""
  out: dict = {}
  for counters in parts:
    for key, value in counters.items():
      if key not in out or key in LEVELS or isinstance(value, bool) or not isinstance(value, (int, float)):
        out[key] = value
      elif key in MOSTS:
        out[key] = max(out[key], value)
      else:
        out[key] = out[key] + value
  return out


def whole_timeline(segments: list[dict]) -> dict:
  """The segments' timelines end to end on one clock (each shifted by the durations before it), with a
  `resume` lane marking where each resumed segment begins; a segment killed before it ended has no
  timeline, only its duration."""
  out: dict[str, list] = {}
  offset = 0.0
  for i, segment in enumerate(segments):
    lanes = segment["timeline"] or {}
    if i:
      out.setdefault("resume", []).append((offset, offset, f"resumed after step {segment['first_step']}"))
    for name, spans in lanes.items():
      out.setdefault(name, []).extend((offset + b, offset + e, label) for b, e, label in spans)
    ends = [e for spans in lanes.values() for _, e, _ in spans]
    offset += max([segment["seconds"], *ends])
  return out


class RunRecord:
  """WORKDIR/run.json kept true while a segment runs: `step` after each trained step, `end` with its timeline."""

  def __init__(self, workdir: Path, resumed_at: int | None, clock=time.perf_counter):
    self.workdir, self._clock = Path(workdir), clock
    self.segments = begin(self.workdir, resumed_at)
    self._start = clock()
    save(self.workdir, self.segments)

  def step(self, step: int) -> None:
    self.segments = stepped(self.segments, step, self._clock() - self._start)
    save(self.workdir, self.segments)

  def end(self, timeline: dict, counters: dict, arm_counters: dict | None = None) -> None:
    self.segments = ended(self.segments, timeline, counters, self._clock() - self._start, arm_counters)
    save(self.workdir, self.segments)
