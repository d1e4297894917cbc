"""Packed sequences: samples end to end in fixed-length rows with segment ids. The packed forward equals
the unpacked one, no token sees another sample, every objective and aggregation gives the same loss, the
trainer's packed gradient equals the unpacked one (streamed in token-budget chunks too), and the packer
places every token once without splitting a sample."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.models import Transformer
from streamrl_jax.training import OBJECTIVES, MicroBatcher, ObjectiveConfig
from streamrl_jax.training.objectives import aggregate, policy_loss
from streamrl_jax.training.packing import (CALL_COST_TOKENS, pack_plan, pack_rows, packed_pieces, packed_shapes,
                                           trim_step, trimmed_call)
from tests.trainer_setup import CONFIG, make_batch, mean_gradient, trainer_for

LENGTH = 24  # packed row length: every sample of make_batch(length=14) fits, two or three to a row


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(3))


def per_token_batch(rows: int, seed: int) -> dict:
  batch = make_batch(rows, seed=seed)
  batch["advantages"] = np.repeat(batch["advantages"][:, None], batch["tokens"].shape[1], axis=1)
  return batch


def test_packed_forward_equals_unpacked_and_samples_stay_apart(model):
  batch = per_token_batch(9, seed=4)
  valid = np.asarray(batch["valid"])
  batch["origin"] = np.arange(valid.size, dtype=np.int32).reshape(valid.shape)  # moves with its token
  packed = pack_rows(batch, LENGTH)
  assert len(packed["tokens"]) < 9 and packed["segment_ids"].max() >= 2  # samples share rows
  plain = model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["valid"]))
  logits = model(jnp.asarray(packed["tokens"]), jnp.asarray(packed["valid"]), jnp.asarray(packed["segment_ids"]))
  real = packed["segment_ids"] > 0
  expected = np.asarray(plain).reshape(-1, CONFIG.vocab_size)[packed["origin"][real]]
  np.testing.assert_allclose(np.asarray(logits)[real], expected, rtol=1e-5, atol=1e-5)
  assert sorted(packed["origin"][real].tolist()) == sorted(batch["origin"][valid].tolist())

  # Changing one sample's tokens leaves every other sample of its row as it was; without segment ids the
  # later samples of the row would see it (the check can fail).
  row = int(np.argmax(packed["segment_ids"].max(axis=1)))
  first = packed["segment_ids"][row] == 1
  others = packed["segment_ids"][row] > 1
  changed = packed["tokens"].copy()
  changed[row, first] = (changed[row, first] + 7) % CONFIG.vocab_size
  after = model(jnp.asarray(changed), jnp.asarray(packed["valid"]), jnp.asarray(packed["segment_ids"]))
  np.testing.assert_allclose(np.asarray(after)[row, others], np.asarray(logits)[row, others], rtol=1e-6, atol=1e-6)
  leaky = [model(jnp.asarray(t), jnp.asarray(packed["valid"]))[row] for t in (packed["tokens"], changed)]
  assert np.abs(np.asarray(leaky[0] - leaky[1])[others]).max() > 1e-3


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"])
def test_every_objective_gives_the_same_loss_packed(aggregation):
  batch = per_token_batch(11, seed=5)
  rng = np.random.default_rng(0)
  batch["logp"] = np.where(batch["valid"], rng.normal(-3.9, 0.3, batch["valid"].shape), 0).astype(np.float32)
  packed = pack_rows(batch, LENGTH)
  for objective in OBJECTIVES.names():
    cfg = ObjectiveConfig(objective=objective, aggregation=aggregation, constant_normalizer=16.0,
                          correction=("geometric_tis", "token_mask", "veto"))
    sums = []
    for b, segments in ((batch, None), (packed, packed["segment_ids"])):
      given = {k: jnp.asarray(v) for k, v in b.items()}
      given["old_logprobs"] = given["logp"] * 0.9  # a correction with something to weigh
      per_token, fix = policy_loss(given["logp"], given, cfg, None if segments is None else given["segment_ids"])
      sums.append([float(x) for x in aggregate(per_token, given["loss_mask"] & fix.keep, cfg,
                                               None if segments is None else jnp.asarray(segments))])
    np.testing.assert_allclose(sums[1], sums[0], rtol=1e-5, err_msg=f"{objective}/{aggregation}")
  if aggregation.startswith("seq"):  # a row of several samples counts each: ignoring the segments would not
    cfg = ObjectiveConfig(aggregation=aggregation)
    unsegmented = aggregate(jnp.ones(packed["tokens"].shape), jnp.asarray(packed["loss_mask"]), cfg)
    assert float(unsegmented[1]) < float(sums[0][1])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_packed_gradient_equals_unpacked_streamed_in_token_chunks(model, aggregation):
  graphdef, params = nnx.split(model)
  trainer = trainer_for(graphdef, ObjectiveConfig(correction=("sequence_tis", "icepop"), aggregation=aggregation,
                                                  entropy_coef=0.01))
  batch = make_batch(13, seed=6)
  full = trainer.accumulate(trainer.init_state(params), batch)
  batcher = MicroBatcher(trainer, pack_length=LENGTH, chunk_tokens=60)
  state = trainer.init_state(params)
  for part in (slice(0, 5), slice(5, 6), slice(6, 13)):
    state = batcher.add(state, {k: v[part] for k, v in batch.items()})
  state = batcher.flush(state)
  assert batcher.counters["calls"] >= 2 and all(shape[1] == LENGTH for shape in trainer.compiled_shapes
                                                if shape != (16, 16))
  assert batcher.counters["real_tokens"] == int(batch["valid"].sum())
  np.testing.assert_allclose(float(state.sums["denominator"]), float(full.sums["denominator"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(mean_gradient(state)), jax.tree.leaves(mean_gradient(full))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20)), min_size=1, max_size=30), st.integers(20, 40))
def test_pack_rows_places_every_token_once_and_never_splits_a_sample(spans, length):
  width = 26
  valid = np.zeros((len(spans), width), bool)
  for row, (start, count) in enumerate(spans):
    valid[row, start:start + count] = True
  tokens = np.arange(valid.size, dtype=np.int32).reshape(valid.shape)  # every token its own id
  packed = pack_rows({"tokens": tokens, "valid": valid}, length)
  seg = packed["segment_ids"]
  assert packed["tokens"].shape[1] == length and np.array_equal(packed["valid"], seg > 0)
  assert sorted(packed["tokens"][seg > 0].tolist()) == sorted(tokens[valid].tolist())  # each exactly once
  for prow in range(len(seg)):
    ids = seg[prow][seg[prow] > 0]
    assert list(np.unique(ids)) == list(range(1, ids.max() + 1)) if ids.size else True
    for s in np.unique(ids):
      got = packed["tokens"][prow][seg[prow] == s]
      row = int(got[0]) // width
      assert np.array_equal(got, tokens[row][valid[row]])  # one whole sample, in order, contiguous
  fills = (seg > 0).sum(axis=1)
  smallest = [min(np.bincount(row[row > 0])[1:]) for row in seg]
  for j in range(len(seg)):  # first fit: each sample of a later row did not fit any earlier row
    assert all(fills[i] + smallest[j] > length for i in range(j))


def test_pack_rows_refuses_what_it_cannot_pack():
  valid = np.array([[True, False, True]])
  with pytest.raises(ValueError, match="row 0: its valid tokens are not contiguous"):
    pack_rows({"tokens": np.zeros((1, 3), np.int32), "valid": valid}, 8)
  with pytest.raises(ValueError, match="a sample of 3 tokens does not fit packed rows of 2"):
    pack_rows({"tokens": np.zeros((1, 3), np.int32), "valid": np.ones((1, 3), bool)}, 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=40), st.sampled_from([1, 2, 4]), st.sampled_from([24, 96]),
       st.integers(0, 3))
def test_packed_pieces_cover_the_chunk_in_few_shapes(shares, unit, length, spare_units):
  fills = [max(1, int(s * length)) for s in shares]
  valid = np.arange(length)[None] < np.asarray(fills)[:, None]
  chunk = {"tokens": np.arange(valid.size, dtype=np.int32).reshape(valid.shape), "valid": valid}
  max_rows = unit * (-(-len(fills) // unit) + spare_units)  # the MicroBatcher's full call: it holds the chunk
  pieces = packed_pieces(chunk, unit, max_rows)
  rows = [len(p["tokens"]) for p in pieces]
  for i, r in enumerate(rows):
    power = r % unit == 0 and (r // unit) & (r // unit - 1) == 0  # a power of two of units
    assert power or r == max_rows or (i == len(rows) - 1 and r <= unit), rows  # a full call, or the last unit
  padded_rows = sum(rows) - len(fills)
  assert 0 <= padded_rows < len(fills) + unit  # never twice the rows
  trimmed = [p for p in pieces if p["tokens"].shape[1] < length]
  assert len(trimmed) <= 1 and all(len(p["tokens"]) <= unit for p in trimmed)
  for p in trimmed:
    assert p["tokens"].shape[1] % trim_step(length) == 0 and p["tokens"].shape[1] >= int(p["valid"].sum(axis=1).max())

  def cost(cut):  # rows computed (a trimmed piece in proportion to its columns) plus each call's fixed cost
    return sum(len(p["tokens"]) * p["tokens"].shape[1] / length + CALL_COST_TOKENS / length for p in cut)
  units = len(fills) // unit
  plain = [{"tokens": np.zeros((unit << b, length))} for b in range(units.bit_length()) if units >> b & 1]
  if len(fills) % unit:
    plain.append({"tokens": np.zeros((unit, length))})
  assert cost(pieces) <= cost(plain) + 1e-9  # never worse than power-of-two pieces without padding or trimming
  shapes = set(packed_shapes(unit, max_rows * length, length))
  compiled = [(-(-len(p["tokens"]) // unit) * unit, p["tokens"].shape[1]) for p in pieces]  # as Trainer.prepare pads
  assert set(compiled) <= shapes  # what precompile_packed compiles covers every piece
  # few trimmed programs: a unit of rows in quarters of the row, a full call in sixteenths above half the row
  assert len([s for s in shapes if s[1] < length]) <= 3 + 7
  kept = np.concatenate([p["tokens"][p["valid"]] for p in pieces])
  assert np.array_equal(np.sort(kept), np.sort(chunk["tokens"][valid]))  # nothing dropped


@pytest.mark.parametrize("fills, length, width", [
    ([79, 60, 50], 96, 80),  # SmolLM2's sums in rows of 96: to 80 columns (at quarters of the row it stayed 96)
    ([40, 49], 96, 56), ([88, 20], 96, 88), ([48], 96, 96),  # half the row or less: never trimmed
    ([2400, 2000], 4096, 2560), ([4000], 4096, 4096),  # sixteenths of a long row
])
def test_a_full_call_is_trimmed_to_its_longest_fill_in_sixteenths_of_the_row(fills, length, width):
  valid = np.arange(length)[None] < np.asarray(fills)[:, None]
  chunk = {"tokens": np.ones(valid.shape, np.int32), "valid": valid}
  assert trimmed_call(chunk)["valid"].shape == (len(fills), width)
  assert (len(fills), width) in packed_shapes(len(fills), len(fills) * length, length)  # precompile covers it


class _RecordingTrainer:
  """What MicroBatcher needs of a trainer, recording each call's packed rows instead of training."""

  def __init__(self, unit: int):
    self.packed_row_quantum, self.calls, self.last_shape = unit, [], (0, 0)

  def accumulate(self, state, piece):
    self.calls.append(piece)
    self.last_shape = (-(-len(piece["tokens"]) // self.packed_row_quantum) * self.packed_row_quantum,
                       piece["tokens"].shape[1])
    return state


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 24), min_size=1, max_size=60), st.lists(st.integers(1, 9), min_size=1, max_size=20),
       st.sampled_from([1, 2]), st.integers(24, 24 * 9))
def test_packed_calls_are_full_rows_of_one_shape_and_train_every_sample_once(lengths, arrivals, unit, chunk_tokens):
  width = 24
  valid = np.arange(width)[None] < np.asarray(lengths)[:, None]
  tokens = np.arange(valid.size, dtype=np.int32).reshape(valid.shape) + 1  # every token its own id
  trainer = _RecordingTrainer(unit)
  batcher = MicroBatcher(trainer, pack_length=width, chunk_tokens=chunk_tokens)
  rows = batcher.call_rows
  assert rows % unit == 0 and rows * width <= max(chunk_tokens, unit * width) < (rows + unit) * width  # all it holds
  start, i = 0, 0
  while start < len(lengths):
    stop = start + arrivals[i % len(arrivals)]
    batcher.add(None, {"tokens": tokens[start:stop], "valid": valid[start:stop]})
    trained = {int(t) for c in trainer.calls for t in c["tokens"][c["valid"]]}
    waiting = [r for r in range(min(stop, len(lengths))) if lengths[r] and int(tokens[r, 0]) not in trained]
    assert len(pack_plan(valid[waiting], width)) <= rows  # what waits fills no more than one call
    start, i = stop, i + 1
  full = len(trainer.calls)
  for c in trainer.calls:  # every call before the flush is full: its rows, cut at most to their longest fill
    assert len(c["tokens"]) == rows and c["valid"].sum(axis=1).max() <= c["tokens"].shape[1] and (
        c["tokens"].shape[1] == width or 2 * c["tokens"].shape[1] > width)
  batcher.flush(None)
  assert len(trainer.calls) - full <= max(1, rows // unit).bit_length() + 1  # the rest: few pieces
  trained = np.concatenate([c["tokens"][c["valid"]] for c in trainer.calls]) if trainer.calls else np.zeros(0)
  assert np.array_equal(np.sort(trained), np.sort(tokens[valid]))  # each token once: no sample lost or repeated
  assert batcher.counters["real_tokens"] == int(valid.sum()) and batcher.pending_rows == 0
  shapes = {(-(-len(c["tokens"]) // unit) * unit, c["tokens"].shape[1]) for c in trainer.calls}  # as prepare pads
  assert shapes <= set(packed_shapes(unit, chunk_tokens, width))  # what precompile_packed compiles covers them


def test_a_sample_too_long_for_the_row_is_refused_and_the_batcher_goes_on():
  trainer = _RecordingTrainer(1)
  batcher = MicroBatcher(trainer, pack_length=8, chunk_tokens=16)
  good = {"tokens": np.arange(1, 7, dtype=np.int32).reshape(2, 3), "valid": np.ones((2, 3), bool)}
  batcher.add(None, good)
  long = {"tokens": np.ones((1, 9), np.int32), "valid": np.ones((1, 9), bool)}
  with pytest.raises(ValueError, match="a sample of 9 tokens does not fit packed rows of 8"):
    batcher.add(None, long)
  batcher.flush(None)  # what was kept before the refusal still trains, once
  trained = np.concatenate([c["tokens"][c["valid"]] for c in trainer.calls])
  assert sorted(trained.tolist()) == list(range(1, 7)) and batcher.rows_seen == 2
