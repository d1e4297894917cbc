"""Where each step's metrics row goes as a run trains (process 0): metrics.jsonl, TensorBoard and W&B as
`JobConfig.report_to` asks, the run's record, and the caller's progress display."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from streamrl_jax.records.metrics_log import (WandbRun, add_row, append_row, open_metrics, read_metrics,
                                              tensorboard_writer)
from streamrl_jax.records.run_record import RunRecord, run_id


@contextlib.contextmanager
def wandb_run(workdir: Path, report_to: tuple[str, ...], settings: dict, leader: bool):
  """The run's W&B run where `report_to` names it (process 0), else None; finished as failed when the job
  raises."""
  run = WandbRun(workdir, run_id(workdir), settings) if leader and "wandb" in report_to else None
  try:
    yield run
  except BaseException:
    if run is not None:
      run.close(failed=True)
      run = None
    raise
  finally:
    if run is not None:
      run.close()


@contextlib.contextmanager
def step_outputs(workdir: Path, resumed_at: int | None, progress: Callable[[dict], None] | None, record: RunRecord,
                 report_to: tuple[str, ...], tracker: WandbRun | None):
  """An on_step callback that appends to metrics.jsonl, TensorBoard and W&B (as `report_to` says), keeps the run's
  record and updates the progress display. On a resume from the checkpoint after step `resumed_at`, metrics of later
  steps (written before a crash, and about to be trained again) are dropped first, from metrics.jsonl and
  TensorBoard, so each step appears once."""
  with open_metrics(workdir, resumed_at) as out:
    writer = tensorboard_writer(workdir, read_metrics(workdir)) if "tensorboard" in report_to else None

    def on_step(row: dict) -> None:
      append_row(out, row)
      if writer is not None:
        add_row(writer, row)
      if tracker is not None:
        tracker.add(row)
      record.step(row["step"])
      if progress is not None:
        progress(row)
    try:
      yield on_step
    finally:
      if writer is not None:
        writer.close()
