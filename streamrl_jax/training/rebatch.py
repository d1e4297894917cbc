"""Re-chunks streamed micro-batches of any size into the train step's calls.

Samples arrive in micro-batches of whatever size the sampler finished; padding each to a shape
bucket would waste compute. `MicroBatcher` keeps what does not fill a chunk on the host and carries it
into the next one (the accumulated gradient is a sum, so the grouping does not change it).

Two ways to cut chunks: `chunk_rows` rows padded to the longest of them (then to a power of two), or,
with `pack_length`, samples packed end to end into rows of that many tokens (`packing.pack_rows`) and a call
whenever `chunk_tokens` real tokens are waiting: compute follows the tokens that arrived.
"""

from __future__ import annotations

import numpy as np

from streamrl_jax.training.packing import pack_rows, packed_pieces
from streamrl_jax.training.step import Trainer, TrainState


class MicroBatcher:
  """`add(state, batch) -> state` runs every full chunk; `finish(state) -> (state, metrics)` runs the
  rest and the optimizer step. Holds less than one chunk (`chunk_rows` rows, or with `pack_length`,
  `chunk_tokens` real tokens) between calls."""

  def __init__(self, trainer: Trainer, chunk_rows: int = 16, pack_length: int = 0, chunk_tokens: int = 0):
    if chunk_rows < 1:
      raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if pack_length < 0 or (pack_length and chunk_tokens < pack_length):
      raise ValueError(f"packing needs chunk_tokens ({chunk_tokens}) >= pack_length ({pack_length}) > 0")
    self.trainer, self.chunk_rows = trainer, chunk_rows
    self.pack_length, self.chunk_tokens = pack_length, chunk_tokens
    self._pending: list[dict] = []
    self.rows_seen = 0
    self.counters = dict(calls=0, real_tokens=0, computed_tokens=0)

  @property
  def pending_tokens(self) -> int:
    return sum(int(np.count_nonzero(b["valid"])) for b in self._pending)

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
    if self.pack_length:
      while self.pending_tokens >= self.chunk_tokens:
        state = self._run(state, self._take_tokens(self.chunk_tokens))
      return state
    while self.pending_rows >= self.chunk_rows:
      state = self._run(state, self._take(self.chunk_rows))
    return state

  def flush(self, state: TrainState) -> TrainState:
    """Runs what is pending (one padded chunk) without an optimizer step."""
    if self._pending:
      chunk = self._take_tokens(self.pending_tokens) if self.pack_length else self._take(self.pending_rows)
      state = self._run(state, chunk)
    return state

  def _take_tokens(self, tokens: int) -> dict:
    """The first pending samples holding up to `tokens` real tokens (at least one), packed."""
    merged = {k: np.concatenate([b[k] for b in self._pending]) for k in self._pending[0]}
    counts = np.cumsum(np.count_nonzero(merged["valid"], axis=1))
    rows = max(1, int(np.searchsorted(counts, tokens, side="right")))
    rest = {k: v[rows:] for k, v in merged.items()}
    self._pending = [rest] if len(rest["tokens"]) else []
    return pack_rows({k: v[:rows] for k, v in merged.items()}, self.pack_length)

  def _run(self, state: TrainState, chunk: dict) -> TrainState:
    """Accumulates a chunk; a packed one in the pieces of `packed_pieces`."""
    pieces = [chunk]
    if self.pack_length:
      pieces = packed_pieces(chunk, self.trainer.packed_row_quantum)
    for piece in pieces:
      self.counters["calls"] += 1
      self.counters["real_tokens"] += int(np.count_nonzero(piece["valid"]))
      state = self.trainer.accumulate(state, piece)
      self.counters["computed_tokens"] += int(np.prod(self.trainer.last_shape))
    return state

  def finish(self, state: TrainState) -> tuple[TrainState, dict]:
    """Flushes, then one optimizer step for everything added since the last one."""
    if self.rows_seen == 0:
      raise ValueError("finish() with no rows since the last optimizer step")
    self.rows_seen = 0
    return self.trainer.apply(self.flush(state))


def _pad_columns(batch: dict, width: int) -> dict:
  return {k: np.pad(v, ((0, 0), (0, width - v.shape[1]))) for k, v in batch.items()}
