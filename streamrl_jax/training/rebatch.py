"""Re-chunks streamed micro-batches of any size into the train step's calls.

Samples arrive in micro-batches of whatever size the sampler finished; padding each to a shape
bucket would waste compute. `MicroBatcher` keeps what does not fill a chunk on the host and carries it
into the next one (the accumulated gradient is a sum, so the grouping does not change it).

Two ways to cut chunks: `chunk_rows` rows padded to the longest of them (then to a power of two), or,
with `pack_length`, samples packed end to end into rows of that many tokens (`pack_rows`) and a call
whenever `chunk_tokens` real tokens are waiting: compute follows the tokens that arrived.
"""

from __future__ import annotations

import numpy as np

from streamrl_jax.training.step import Trainer, TrainState


def activation_bytes_per_token(model_config, length: int) -> int:
  """A float32 training step's live activations per token, roughly: per layer the residual, norms, q/k/v,
  attention weights over `length` keys, the MLP's three projections; then the logits and their gradient."""
  c = model_config
  kv = 2 * c.num_kv_heads * (c.head_dim or c.hidden_size // c.num_heads)
  per_layer = 6 * c.hidden_size + kv + 3 * c.intermediate_size + 2 * c.num_heads * length
  return 4 * (c.num_layers * per_layer + 3 * c.vocab_size)


def chunk_tokens_for(model_config, length: int, wanted: int, memory_bytes: int) -> int:
  """Real tokens per trainer call: `wanted`, within `memory_bytes` of activations, a whole number of packed
  rows of `length` (at least one)."""
  fits = memory_bytes // activation_bytes_per_token(model_config, length)
  return max(length, min(wanted, fits) // length * length)


def pack_rows(batch: dict, length: int) -> dict:
  """The batch's samples (rows; their valid tokens contiguous) packed end to end into rows of `length`
  tokens, first-fit by decreasing length. Every per-token field moves with its tokens; `segment_ids` numbers
  the samples of a row 1, 2, ... (0: padding). A sample is never split across rows."""
  valid = np.asarray(batch["valid"], bool)
  spans = []
  for row, mask in enumerate(valid):
    where = np.flatnonzero(mask)
    if where.size == 0:
      continue
    start, count = int(where[0]), int(where.size)
    if where[-1] - start + 1 != count:
      raise ValueError(f"row {row}: its valid tokens are not contiguous; a sample cannot be packed")
    if count > length:
      raise ValueError(f"row {row}: a sample of {count} tokens does not fit packed rows of {length}")
    spans.append((row, start, count))
  spans.sort(key=lambda span: -span[2])
  fill: list[int] = []
  placed = []  # (packed row, offset, source row, start, count)
  for row, start, count in spans:
    target = next((i for i, used in enumerate(fill) if used + count <= length), len(fill))
    if target == len(fill):
      fill.append(0)
    placed.append((target, fill[target], row, start, count))
    fill[target] += count
  out = {k: np.zeros((len(fill), length), np.asarray(v).dtype) for k, v in batch.items()}
  out["segment_ids"] = np.zeros((len(fill), length), np.int32)
  segment = [0] * len(fill)
  for target, offset, row, start, count in sorted(placed):
    for key, value in batch.items():
      out[key][target, offset:offset + count] = np.asarray(value)[row, start:start + count]
    segment[target] += 1
    out["segment_ids"][target, offset:offset + count] = segment[target]
  return out


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


TRIM_MULTIPLE = 8
ROW_SLACK = 0.03  # padded rows a packed chunk may take to be sent in fewer calls, as a share of its rows


def packed_pieces(chunk: dict, unit: int) -> list[dict]:
  """A packed chunk cut for the trainer: its full rows in power-of-two numbers of `unit` rows (the trainer's
  batch shards), rounded up by at most `ROW_SLACK` padded rows where that saves calls; then a last partly
  filled `unit` of rows cut to its longest fill, rounded up to `TRIM_MULTIPLE` columns. Few shapes to
  compile, and little padding."""
  rows, length = chunk["tokens"].shape
  tail_rows = rows % unit or unit
  fill = int(np.count_nonzero(chunk["valid"][rows - tail_rows:], axis=1).max())
  width = min(length, -(-fill // TRIM_MULTIPLE) * TRIM_MULTIPLE)
  head = rows if width == length and rows % unit == 0 else rows - tail_rows
  units = head // unit
  for shift in range(units.bit_length(), -1, -1):  # the coarsest rounding within the slack
    padded = -(-units // (1 << shift)) << shift
    if padded - units <= ROW_SLACK * units:
      break
  pieces, start = [], 0
  for bit in reversed(range(padded.bit_length())):
    if padded >> bit & 1:
      size = unit << bit
      piece = {k: v[start:min(start + size, head)] for k, v in chunk.items()}
      missing = size - len(piece["tokens"])
      pieces.append({k: np.pad(v, ((0, missing), (0, 0))) for k, v in piece.items()} if missing else piece)
      start += size
  if head < rows:
    pieces.append({k: v[head:, :width] for k, v in chunk.items()})
  return pieces


def _pad_columns(batch: dict, width: int) -> dict:
  return {k: np.pad(v, ((0, 0), (0, width - v.shape[1]))) for k, v in batch.items()}
