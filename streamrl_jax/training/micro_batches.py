"""Re-chunks streamed micro-batches of any size into the train step's calls.

Samples arrive in micro-batches of whatever size the sampler finished; padding each to a shape
bucket would waste compute. `MicroBatcher` keeps what does not fill a chunk on the host and carries it
into the next one (the accumulated gradient is a sum, so the grouping does not change it).

Two ways to cut chunks: `chunk_rows` rows padded to the longest of them (then to a power of two), or,
with `pack_length`, samples packed end to end into rows of that many tokens (`packing.pack_plan`) and a call of
`call_rows` full rows whenever the waiting samples fill more than that: compute follows the tokens that arrived,
every call but the step's last has one row count (at full width, or cut to its longest row), and each call's fixed
cost (the gradient's buffers, its sum into the state: about a tenth of a SmolLM2 call of 8 rows) is paid once per
`call_rows` rows.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from streamrl_jax.counters import Counters
from streamrl_jax.training.host_batch import pad_rows
from streamrl_jax.training.packing import call_rows, pack_plan, pack_rows, packed_pieces, trimmed_call
from streamrl_jax.training.trainer import Trainer, TrainState


@dataclasses.dataclass(slots=True, eq=False)
class BatcherCounters(Counters):
  """Trainer calls, and the tokens they carried and computed (padding included)."""

  calls: int = 0
  real_tokens: int = 0
  computed_tokens: int = 0


class MicroBatcher:
  """`add(state, batch) -> state` runs every full chunk; `finish(state) -> (state, metrics)` runs the
  rest and the optimizer step. Holds less than one chunk (`chunk_rows` rows, or with `pack_length`, what packs
  into at most `call_rows` rows) between calls. `chunk_tokens` bounds a packed call's tokens (padding included):
  `call_rows` is the most whole units of the trainer's batch shards whose rows hold no more."""

  def __init__(self, trainer: Trainer, chunk_rows: int = 16, pack_length: int = 0, chunk_tokens: int = 0):
    if chunk_rows < 1:
      raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if pack_length < 0 or (pack_length and chunk_tokens < pack_length):
      raise ValueError(f"packing needs chunk_tokens ({chunk_tokens}) >= pack_length ({pack_length}) > 0")
    self.trainer, self.chunk_rows = trainer, chunk_rows
    self.pack_length, self.chunk_tokens = pack_length, chunk_tokens
    self.call_rows = call_rows(trainer.packed_row_quantum, chunk_tokens, pack_length) if pack_length else 0
    self._pending: list[dict] = []
    self.rows_seen = 0
    self.counters = BatcherCounters()

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
    if self.pack_length:
      pack_plan(batch["valid"], self.pack_length, _owners(batch))  # refuses an unpackable sample before keeping it
    self.rows_seen += len(batch["tokens"])
    if self.pack_length:  # a sample without tokens carries no loss and takes no row
      batch = {k: v[batch["valid"].any(axis=1)] for k, v in batch.items()}
    self._pending.append(batch)
    if self.pack_length:
      while self.pending_rows > self.call_rows:
        merged = self._merged()
        plan = pack_plan(merged["valid"], self.pack_length, _owners(merged))
        if len(plan) <= self.call_rows:
          break
        state = self._run(state, trimmed_call(self._take_packed(merged, plan[:self.call_rows])), cut=False)
      return state
    while self.pending_rows >= self.chunk_rows:
      state = self._run(state, self._take(self.chunk_rows))
    return state

  def flush(self, state: TrainState) -> TrainState:
    """Runs what is pending (one padded chunk) without an optimizer step."""
    if self._pending:
      if self.pack_length:
        merged = self._merged()
        plan = pack_plan(merged["valid"], self.pack_length, _owners(merged))
        chunk = self._take_packed(merged, plan)
        return self._run(state, chunk) if plan else state  # samples without tokens carry no loss
      state = self._run(state, self._take(self.pending_rows))
    return state

  def _merged(self) -> dict:
    return {k: np.concatenate([b[k] for b in self._pending]) for k in self._pending[0]}

  def _take_packed(self, merged: dict, plan: list) -> dict:
    """The samples `plan` places, packed; the others stay pending."""
    taken = np.zeros(len(merged["tokens"]), bool)
    for spans in plan:
      for row, _, _ in spans:
        taken[row] = True
    rest = ~taken
    self._pending = [{k: v[rest] for k, v in merged.items()}] if rest.any() else []
    return pack_rows(merged, self.pack_length, plan)

  def _run(self, state: TrainState, chunk: dict, cut: bool = True) -> TrainState:
    """Accumulates a chunk; a packed one (unless it is a full call, `cut=False`) in the pieces of
    `packed_pieces`."""
    pieces = [chunk]
    if self.pack_length and cut:
      pieces = packed_pieces(chunk, self.trainer.packed_row_quantum, self.call_rows)
    for piece in pieces:
      self.counters.calls += 1
      self.counters.real_tokens += int(np.count_nonzero(piece["valid"]))
      state = self.trainer.accumulate(state, piece)
      self.counters.computed_tokens += int(np.prod(self.trainer.last_shape))
    return state

  def discard(self) -> None:
    """Drops what was added since the last optimizer step and is still pending (a step skipped: its rows carry no
    loss, so what already ran added nothing)."""
    self._pending, self.rows_seen = [], 0

  def finish(self, state: TrainState) -> tuple[TrainState, dict]:
    """Flushes, then one optimizer step for everything added since the last one."""
    if self.rows_seen == 0:
      raise ValueError("finish() with no rows since the last optimizer step")
    self.rows_seen = 0
    return self.trainer.apply(self.flush(state))


def _owners(batch: dict):
  """Each sample's trainer process (a trainer of several processes), or None."""
  return batch["owners"][:, 0] if "owners" in batch else None


def _pad_columns(batch: dict, width: int) -> dict:
  return {k: pad_rows(v, 0, width - v.shape[1]) for k, v in batch.items()}
