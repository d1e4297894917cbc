"""What a multi-turn sampler does to a decode engine's rows besides decoding them: `extend` a paused row with
new tokens (a tool's output) by a prefill of just those tokens over its cache, and `park`/`unpark` rows waiting
on a tool off their slots and back. A mixin of `engine.DecodeEngine`, whose jitted `_extend` and `_move` run
the `_impl`s here (one jit boundary: the engine's)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class RowMoves:
  """`extend`, `init_parking`, `park`, `unpark` of an engine with `config`, `graphdef`, `init_decode_state`,
  its jitted `_extend` and `_move`, and `_sample_next` (the decode step's sampling half)."""

  def extend(self, params, decode_state, slots: Sequence[int], tokens: Sequence[Sequence[int]]):
    """Appends `tokens[i]` to the paused row in slot `slots[i]` (a row a stop token ended: the first of its
    tokens is that stop token, the rest a tool's output) with one prefill of just those tokens over the row's
    cache, the history not prefilled again; then samples each row's next token and makes it active again.
    Only those rows are computed (gathered from their slots, up to `prefill_batch` a call, and put back).
    Returns (state, [((token, logprob, done) device arrays of a call, row)] one entry per slot): no device op
    runs outside the calls, so nothing compiles per row count. Compiles once per row bucket (`row_buckets`)
    and power-of-two length from 8 up to the cache length (`extend_buckets`)."""
    num_slots = self.config.num_slots
    if len(slots) != len(tokens) or len(set(slots)) != len(slots) or any(not 0 <= s < num_slots for s in slots):
      raise ValueError(f"extend takes distinct slots in 0..{num_slots - 1}, one token list each; got {list(slots)}")
    if not slots or min(len(t) for t in tokens) < 1 or max(len(t) for t in tokens) > self.config.cache_length:
      raise ValueError(f"extend appends 1..{self.config.cache_length} tokens to each of 1 or more rows, got "
                       f"lengths {[len(t) for t in tokens]}")
    outputs = []
    for start in range(0, len(slots), self.config.prefill_batch):
      part, rows_tokens = slots[start:start + self.config.prefill_batch], tokens[start:start + self.config.prefill_batch]
      rows = next(r for r in self.config.row_buckets if r >= len(part))
      bucket = next(b for b in self.config.extend_buckets if b >= max(len(t) for t in rows_tokens))
      chunk, lengths = np.zeros((rows, bucket), np.int32), np.zeros((rows,), np.int32)
      targets = np.full((rows,), num_slots, np.int32)  # padding rows: out of range, dropped when put back
      for i, (slot, row) in enumerate(zip(part, rows_tokens)):
        chunk[i, :len(row)], lengths[i], targets[i] = row, len(row), slot
      decode_state, out = self._extend(params, decode_state, targets, chunk, lengths)
      outputs += [(out, row) for row in range(len(part))]
    return decode_state, outputs

  def _extend_impl(self, params, state, targets, chunk, lengths):
    model = nnx.merge(self.graphdef, params)
    rows = jax.tree.map(lambda a: a[jnp.minimum(targets, self.config.num_slots - 1)], state)
    mask = jnp.arange(chunk.shape[1])[None, :] < lengths[:, None]
    logits, cache = model.forward_with_cache(chunk, rows.cache, mask, logits_at=jnp.maximum(lengths - 1, 0))
    cache = cache.replace(index=rows.cache.index + lengths)  # padding past a row's tokens is overwritten later
    # The first appended token (the stop token) was counted when it was sampled; the tool's tokens count now.
    rows = rows.replace(cache=cache, active=lengths > 0, generated=rows.generated + jnp.maximum(lengths - 1, 0))
    changes, out = self._sample_next(rows, logits)
    rows = rows.replace(**changes)
    state = jax.tree.map(lambda big, small: big.at[targets].set(small, mode="drop"), state, rows)
    return state, (out.tokens, out.logprobs, out.done)

  def init_parking(self):
    """Room for `num_slots` rows parked off their slots (rows waiting on a tool): a decode state's shape."""
    return self.init_decode_state()

  def park(self, decode_state, parking, slots: Sequence[int], places: Sequence[int]):
    """Moves the paused rows of `slots` into `parking` at `places` (their whole cache, token count and knobs),
    so the slots may take other requests; `unpark` brings them back into any free slots. One call for all the
    rows, up to `prefill_batch` a call; compiles once per row bucket. Returns the new `parking`."""
    for a, b in self._row_calls(slots, places):
      parking = self._move(decode_state, parking, a, b, False)
    return parking

  def unpark(self, decode_state, parking, places: Sequence[int], slots: Sequence[int]):
    """Puts parked rows back from `places` into `slots`, inactive until `extend` goes on from them."""
    for a, b in self._row_calls(places, slots):
      decode_state = self._move(parking, decode_state, a, b, True)
    return decode_state

  def _row_calls(self, sources: Sequence[int], targets: Sequence[int]):
    """(source rows, target rows) index arrays of up to `prefill_batch` rows, padded to a row bucket (padding
    targets out of range: dropped)."""
    if len(sources) != len(targets) or len(set(targets)) != len(targets):
      raise ValueError(f"rows to move: {list(sources)} -> {list(targets)}")
    out = []
    for start in range(0, len(sources), self.config.prefill_batch):
      part = list(zip(sources, targets))[start:start + self.config.prefill_batch]
      rows = next(r for r in self.config.row_buckets if r >= len(part))
      a, b = np.zeros((rows,), np.int32), np.full((rows,), self.config.num_slots, np.int32)
      a[:len(part)], b[:len(part)] = zip(*part)
      out.append((a, b))
    return out

  def _move_impl(self, source, target, rows_from, rows_to, inactive: bool):
    rows = jax.tree.map(lambda a: a[rows_from], source)
    if inactive:
      rows = rows.replace(active=jnp.zeros_like(rows.active))
    return jax.tree.map(lambda big, small: big.at[rows_to].set(small, mode="drop"), target, rows)
