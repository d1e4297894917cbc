"""Re-chunks streamed micro-batches of any size into fixed-size chunks for the train step.

Samples arrive in micro-batches of whatever size the sampler finished; padding each to a shape
bucket would waste compute. `MicroBatcher` keeps the rows that do not fill a chunk on the host and
carries them into the next one (the accumulated gradient is a sum, so the grouping does not change
it); only the last chunk of a global batch is padded.
"""

from __future__ import annotations

import numpy as np

from streamrl_jax.training.step import Trainer, TrainState


class MicroBatcher:
  """`add(state, batch) -> state` runs every full chunk; `finish(state) -> (state, metrics)` runs the
  rest and the optimizer step. Holds at most `chunk_rows - 1` rows between calls."""

  def __init__(self, trainer: Trainer, chunk_rows: int = 16):
    if chunk_rows < 1:
      raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    self.trainer, self.chunk_rows = trainer, chunk_rows
    self._pending: list[dict] = []
    self.rows_seen = 0

  @property
  def pending_rows(self) -> int:
    return sum(len(b["tokens"]) for b in self._pending)

  def _take(self, rows: int) -> dict:
    """Removes the first `rows` pending rows, right-trimmed to the longest valid length among them."""
    merged = {k: np.concatenate([b[k] for b in self._pending]) for k in self._pending[0]}
    chunk = {k: v[:rows] for k, v in merged.items()}
    rest = {k: v[rows:] for k, v in merged.items()}
    self._pending = [rest] if len(rest["tokens"]) else []
    length = int(np.max(np.nonzero(chunk["valid"].any(axis=0))[0], initial=0)) + 1
    return {k: v[:, :length] for k, v in chunk.items()}

  def add(self, state: TrainState, batch: dict) -> TrainState:
    batch = {k: np.asarray(v) for k, v in batch.items()}
    if self._pending and set(batch) != set(self._pending[0]):
      raise KeyError(f"micro-batch keys {sorted(batch)} differ from earlier ones {sorted(self._pending[0])}")
    if "advantages" in batch and batch["advantages"].ndim == 1:
      batch["advantages"] = np.repeat(batch["advantages"][:, None], batch["tokens"].shape[1], axis=1)
    if self._pending and batch["tokens"].shape[1] != self._pending[0]["tokens"].shape[1]:
      width = max(batch["tokens"].shape[1], self._pending[0]["tokens"].shape[1])
      self._pending = [_pad_columns(b, width) for b in self._pending]
      batch = _pad_columns(batch, width)
    self._pending.append(batch)
    self.rows_seen += len(batch["tokens"])
    while self.pending_rows >= self.chunk_rows:
      state = self.trainer.accumulate(state, self._take(self.chunk_rows))
    return state

  def flush(self, state: TrainState) -> TrainState:
    """Runs the pending rows (one padded chunk) without an optimizer step."""
    if self._pending:
      state = self.trainer.accumulate(state, self._take(self.pending_rows))
    return state

  def finish(self, state: TrainState) -> tuple[TrainState, dict]:
    """Flushes, then one optimizer step for everything added since the last one."""
    if self.rows_seen == 0:
      raise ValueError("finish() with no rows since the last optimizer step")
    self.rows_seen = 0
    return self.trainer.apply(self.flush(state))


def _pad_columns(batch: dict, width: int) -> dict:
  return {k: np.pad(v, ((0, 0), (0, width - v.shape[1]))) for k, v in batch.items()}
