"""A run's metrics.jsonl: one JSON row per trained step, appended as steps end, read back whole; its TensorBoard
events, which hold the same rows, each step once; and its Weights & Biases run (`WandbRun`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from streamrl_jax.records.metric_table import EVALUATION, check_row


@dataclasses.dataclass(frozen=True)
class PeriodicEval:
  """Held-out evaluation every `every` RL steps, of the policy whose row it is: `evaluate(params)` (host parameters;
  the run's sampling settings, which every arm shares, bound where it is built) gives the row's `heldout_accuracy`
  (and with `JobConfig.eval_k`, `heldout_avg@K` and `heldout_pass@K`)."""

  every: int
  evaluate: Callable[[object], dict[str, float]]

  def row_part(self, params: Callable[[], object]) -> Callable[[dict], dict]:
    """A row part (`metric_table.join_row`): the held-out scores of the policy `params()` gives, on the rows whose
    step is due; `params()` is asked only then."""
    def part(row: dict) -> dict:
      due = self.every and row["step"] % self.every == 0
      return {EVALUATION: {k: float(v) for k, v in self.evaluate(params()).items()}} if due else {}
    return part


def evaluations(rows: list[dict], before: float | None, after: float | None, steps: int,
                key: str = "heldout_accuracy") -> list[tuple[int, float]]:
  """(step, held-out `key`) points of a policy: before RL at step 0, each periodic one, after RL at the end."""
  points = [(0, before)] + [(r["step"], r[key]) for r in rows if key in r]
  return [(x, y) for x, y in points + [(steps, after)] if y is not None]


def sampled_evaluations(rows: list[dict], before: dict[str, float], after: dict[str, float], steps: int
                        ) -> dict[str, list[tuple[int, float]]]:
  """Each evaluation-at-k key's (step, value) points (`evaluations`): `before` and `after` hold the scores before
  and after RL (`heldout_avg@K`, `heldout_pass@K`; empty where there was none)."""
  keys = sorted({k for k in [*before, *after, *(k for r in rows for k in r)] if k.startswith(("heldout_avg@",
                                                                                               "heldout_pass@"))})
  return {k: evaluations(rows, before.get(k), after.get(k), steps, k) for k in keys}


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


def append_row(out: IO[str], row: dict) -> None:
  """`row` (its keys checked against the metrics table) as a line of an open metrics.jsonl, flushed."""
  out.write(json.dumps(check_row(row)) + "\n")
  out.flush()


def tensorboard_writer(directory: Path, rows: list[dict]):
  """A `tensorboardX.SummaryWriter` on DIRECTORY/tensorboard holding `rows` (`add_row`) and nothing else: the folder
  is written anew, so a resumed run shows each of its steps once (the steps lost to a crash are not left behind
  beside their second run), at the times the rows were written."""
  folder = Path(directory) / "tensorboard"
  shutil.rmtree(folder, ignore_errors=True)
  writer = _summary_writer_class()(str(folder))
  for row in rows:
    add_row(writer, row, flush=False)
  writer.flush()
  return writer


def _summary_writer_class():
  """tensorboardX's `SummaryWriter`, imported without torch: tensorboardX tries `import torch` at import only to accept
  torch tensors as values (rows hold floats), which costs every run's process seconds and hundreds of MB where torch is
  installed. Unless torch is loaded already, that one import is refused while tensorboardX loads."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's fallback
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def add_row(writer, row: dict, flush: bool = True) -> None:
  """A metrics row as TensorBoard scalars at its step (a run with arms names its rows' arm: strings are left out);
  flushed, so it is on disk as metrics.jsonl's row is and a kill loses neither."""
  for key, value in row.items():
    if not isinstance(value, str):
      writer.add_scalar(key, value, row["step"], walltime=row.get("time"))
  if flush:
    writer.flush()


class WandbRun:
  """A run's Weights & Biases run (`JobConfig.report_to` with 'wandb'; the `[wandb]` extra): every metrics row's
  numbers at its step, the run's settings as its config, and its pictures when the run ends. Its files are in
  WORKDIR/wandb; its id is the run's (`run_record.run_id`), so a resumed run continues the same W&B run. wandb's
  own environment decides the rest: WANDB_PROJECT (default "streamrl"), WANDB_ENTITY, WANDB_MODE=offline, the
  API key."""

  def __init__(self, workdir: Path, run_id: str, settings: dict):
    try:
      import wandb
    except ImportError as err:
      raise ImportError("JobConfig.report_to has 'wandb', which needs the wandb package: "
                        "pip install 'streamrl-jax[wandb]'") from err
    import os

    self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "streamrl"), dir=str(workdir), id=run_id,
                           name=Path(workdir).name, config=settings, resume="allow")

  def add(self, row: dict) -> None:
    self._run.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}, step=row["step"])

  def pictures(self, workdir: Path, step: int) -> None:
    """The run's pictures (curves.png, timeline.png) as W&B images at `step`."""
    import wandb

    images = {p.stem: wandb.Image(str(p)) for p in (Path(workdir) / "curves.png", Path(workdir) / "timeline.png")
              if p.exists()}
    if images:
      self._run.log(images, step=step)

  def close(self, failed: bool = False) -> None:
    self._run.finish(exit_code=1 if failed else 0)
