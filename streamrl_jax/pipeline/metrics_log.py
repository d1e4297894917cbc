"""A run's metrics.jsonl: one JSON row per trained step, appended as steps end, read back whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO


def read_metrics(directory: Path) -> list[dict]:
  """The rows of DIRECTORY/metrics.jsonl (each step once; a row cut short by a kill has no newline and is left out)."""
  path = Path(directory) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
          if line.endswith("\n") and line.strip()]


def open_metrics(directory: Path, resumed_at: int | None) -> IO[str]:
  """DIRECTORY/metrics.jsonl open for appending rows: a fresh run's emptied; a run resumed from the checkpoint after
  step `resumed_at` keeps only the rows up to it (later ones were written before a crash and are trained again, so
  each step appears once)."""
  path = Path(directory) / "metrics.jsonl"
  if resumed_at is not None and path.exists():
    kept = [m for m in read_metrics(directory) if m["step"] <= resumed_at]
    path.write_text("".join(json.dumps(m) + "\n" for m in kept))
  return path.open("a" if resumed_at is not None else "w")
