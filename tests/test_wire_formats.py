"""What crosses process boundaries: the Arrow sample schema, weight chunks and the control messages."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import BadMessage, Lease, LeaseReply, Register, StepReport
from streamrl_jax.streaming.sample_schema import (SAMPLE_SCHEMA, BadSampleBatch, SampleEnvelope, WireLimits,
                                                  batch_to_shard, shard_to_batch)
from streamrl_jax.streaming.weight_chunks import (BadWeightStream, WeightAssembler, check_tensors, manifest_of,
                                                  part_indices, partition_tensors, read_manifest, read_weights_ticket,
                                                  weight_batches, weight_schema, weights_ticket)
from tests.wire_samples import VOCAB, _replace_column, group_shard


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=6))
def test_sample_batch_round_trip(lengths):
  shard = group_shard(lengths, functions=2)
  back, envelope = batch_to_shard(shard_to_batch(shard, SampleEnvelope(4, 9)), VOCAB)
  assert envelope == SampleEnvelope(4, 9)
  width = max(lengths)
  for field in ("tokens", "valid", "loss_mask", "logprobs", "versions"):
    np.testing.assert_array_equal(getattr(back, field), getattr(shard, field)[:, :width])
  for field in ("rewards", "group_ids", "sample_indices", "steps", "first_versions", "last_versions", "reward_parts",
                "reward_errors", "reward_timeouts"):
    np.testing.assert_array_equal(getattr(back, field), getattr(shard, field))


LAYERS, K, EXPERTS = 2, 3, 5  # a mixture's routes: each token's 3 experts of 5 at 2 sparse layers
ROUTED = WireLimits(VOCAB, routes=(LAYERS, K, EXPERTS))


def routed_shard(lengths, seed: int = 0, none_for=()):
  """`group_shard(lengths)` with routes (experts + 1; the last token of each row not recorded, rows `none_for`
  without any)."""
  shard = group_shard(lengths, functions=2)
  rng = np.random.default_rng(seed)
  routes = rng.integers(1, EXPERTS + 1, shard.tokens.shape + (LAYERS, K)).astype(np.int16)
  lengths = shard.valid.sum(1)
  routes[~shard.valid] = 0
  routes[np.arange(len(lengths)), lengths - 1] = 0
  routes[list(none_for)] = 0
  return dataclasses.replace(shard, routes=routes)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=5), st.integers(0, 9))
def test_a_mixtures_routes_round_trip_and_rows_without_them_stay_empty(lengths, seed):
  shard = routed_shard(lengths, seed, none_for=[0] if len(lengths) > 1 else [])
  batch = shard_to_batch(shard, SampleEnvelope(1, 2))
  back, _ = batch_to_shard(batch, ROUTED)
  np.testing.assert_array_equal(back.routes, shard.routes[:, :max(lengths)])
  assert back.take([0]).routes.shape == (1, back.tokens.shape[1], LAYERS, K)
  dense, _ = batch_to_shard(shard_to_batch(group_shard(lengths, functions=2), SampleEnvelope(1, 3)), ROUTED)
  assert dense.routes is None  # no row sent any: a shard without routes


@pytest.mark.parametrize("column, problem", [
    ([[1] * 7, []], r"row 0: routes must hold 2 layers x 3 experts for each of its 5 tokens \(30 values\) or none"),
    ([[EXPERTS + 1] * 30, []], r"row 0: routes must lie in \[0, 5\]"),
    ([[], [-1] * 36], r"row 1: routes must lie in \[0, 5\]"),
])
def test_bad_routes_are_refused_by_row(column, problem):
  good = shard_to_batch(group_shard([5, 6], functions=2), SampleEnvelope(0, 1))
  with pytest.raises(BadSampleBatch, match=problem):
    batch_to_shard(_replace_column(good, "routes", pa.array(column, pa.list_(pa.int16()))), ROUTED)


def _bad_batches():
  good = shard_to_batch(group_shard([5, 6], functions=2), SampleEnvelope(0, 1))
  tokens = good.column("tokens").to_pylist()
  return {
      "tokens. has type list<item: int64>, expected list<item: int32>": pa.record_batch(
          [pa.array(tokens, pa.list_(pa.int64())) if f.name == "tokens" else good.column(i)
           for i, f in enumerate(good.schema)],
          schema=pa.schema([pa.field("tokens", pa.list_(pa.int64())) if f.name == "tokens" else f
                            for f in good.schema], metadata=good.schema.metadata)),
      "lacks column 'reward'": pa.record_batch(
          [good.column(i) for i, f in enumerate(good.schema) if f.name != "reward"],
          schema=pa.schema([f for f in good.schema if f.name != "reward"], metadata=good.schema.metadata)),
      "not 'streamrl.samples/6'": good.replace_schema_metadata({}),
      # a sampler of a version before (no routes column): refused by its version
      "of schema 'streamrl.samples/5', this trainer reads 'streamrl.samples/6'": good.replace_schema_metadata(
          {"schema": "streamrl.samples/5"}),
      "routes given, but this run's model has no experts": _replace_column(
          good, "routes", pa.array([[1] * 5 * 6, []], pa.list_(pa.int16()))),
      "row 1: reward_parts must hold one value per reward function": _replace_column(
          good, "reward_parts", pa.array([[1.0], [1.0, 0.0]], pa.list_(pa.float32()))),
      "row 0: reward_parts must be finite": _replace_column(
          good, "reward_parts", pa.array([[float("inf")], [1.0]], pa.list_(pa.float32()))),
      "reward_errors must be >= 0": _replace_column(good, "reward_errors", pa.array([0, -1], pa.int32())),
      r"\[0, 50\)": _replace_column(good, "tokens", pa.array([t[:-1] + [VOCAB] for t in tokens], pa.list_(pa.int32()))),
      "'logprobs' has 4 entries": _replace_column(
          good, "logprobs", pa.array([[0.0] * 4, [0.0] * 6], pa.list_(pa.float32()))),
      "one value for the whole batch": _replace_column(good, "seq", pa.array([1, 2], pa.int64())),
      "reward must be finite": _replace_column(good, "reward", pa.array([0.5, float("nan")], pa.float32())),
      "last_version must be >= first_version": _replace_column(good, "last_version", pa.array([1, 3], pa.int64())),
      "nulls": _replace_column(good, "step", pa.array([3, None], pa.int64())),
      "row 1: versions must be >= 0": _replace_column(
          good, "versions", pa.array([[0, 0, 2, 3, 3], [0, 0, 2, -1, 3, 3]], pa.list_(pa.int64()))),
      "row 0: the newest of versions must be last_version": _replace_column(
          good, "versions", pa.array([[0, 0, 2, 2, 2], [0, 0, 2, 3, 3, 3]], pa.list_(pa.int64()))),
      "loss_mask\\[0\\] must be false": _replace_column(
          good, "loss_mask", pa.array([[True] * 5, [False] * 6], pa.list_(pa.bool_()))),
  }


@pytest.mark.parametrize("problem", list(_bad_batches()))
def test_malformed_sample_batches_are_refused_by_name(problem):
  with pytest.raises(BadSampleBatch, match=problem):
    batch_to_shard(_bad_batches()[problem], VOCAB)


def test_sample_schema_is_fixed():
  assert SAMPLE_SCHEMA.names == ["sampler_id", "seq", "step", "group_id", "sample_index", "tokens",
                                 "loss_mask", "logprobs", "reward", "first_version", "last_version",
                                 "versions", "reward_parts", "reward_errors", "reward_timeouts", "routes"]
  with pytest.raises(ValueError, match="prefix"):
    bad = group_shard([4])
    shard_to_batch(dataclasses.replace(bad, valid=bad.valid[:, ::-1], loss_mask=bad.valid[:, ::-1] & False),
                   SampleEnvelope(0, 0))


def _weights():
  rng = np.random.default_rng(0)
  return {"['a']": rng.normal(size=(3, 5)).astype(np.float32), "['b']": np.arange(100, dtype=np.int32),
          "['c']": np.zeros((0, 4), np.float32), "['d']": rng.normal(size=(7,)).astype(np.float32)}


@pytest.mark.parametrize("chunk_bytes", [8, 64, 1 << 20])
def test_weights_reassemble_from_chunks(chunk_bytes):
  flat = _weights()
  schema = weight_schema(5, manifest_of(flat))
  version, manifest, part = read_manifest(schema)
  assembler = WeightAssembler(manifest, part)
  for batch in weight_batches(schema, list(flat.values()), chunk_bytes):
    assembler.add(batch)
  out = assembler.result()
  assert version == 5 and list(out) == list(flat) and assembler.bytes == sum(a.nbytes for a in flat.values())
  check_tensors(out, {k: v.shape for k, v in flat.items()})
  for name in flat:
    np.testing.assert_array_equal(out[name], flat[name])
    assert out[name].dtype == flat[name].dtype


def test_weight_streams_that_do_not_add_up_are_refused():
  flat = _weights()
  schema = weight_schema(1, manifest_of(flat))
  with pytest.raises(BadWeightStream, match=r"weight \['a'\] has shape \(3, 5\), this model expects \(5, 3\)"):
    check_tensors(flat, {**{k: v.shape for k, v in flat.items()}, "['a']": (5, 3)})
  with pytest.raises(BadWeightStream, match="missing .*'z'.* unexpected"):
    check_tensors(flat, {"['z']": (1,)})
  with pytest.raises(BadWeightStream, match="not 'streamrl.weights/2'"):
    read_manifest(schema.remove_metadata())
  _, manifest, _ = read_manifest(schema)
  assembler = WeightAssembler(manifest)
  batches = list(weight_batches(schema, list(flat.values()), 16))
  for batch in batches[:-1]:
    assembler.add(batch)
  with pytest.raises(BadWeightStream, match=r"\['d'\]: 16 of 28 bytes arrived"):
    assembler.result()
  assembler = WeightAssembler(manifest)
  assembler.add(batches[0])
  with pytest.raises(BadWeightStream, match=r"chunk at byte 0 of weight \['a'\]; 16 bytes of it had arrived"):
    assembler.add(batches[0])  # a repeated chunk
  with pytest.raises(BadWeightStream, match=r"chunk at byte 32 of weight \['a'\]; 16 bytes"):
    assembler.add(batches[2])  # a gap
  one_part = WeightAssembler(manifest, [1])
  with pytest.raises(BadWeightStream, match="chunk of tensor 0, which this stream's part does not carry"):
    one_part.add(batches[0])
  nulls = pa.record_batch([pa.array([0], pa.int32()), pa.array([0], pa.int64()), pa.array([None], pa.large_binary())],
                          schema=schema)
  with pytest.raises(BadWeightStream, match="a weight chunk with a null field"):
    WeightAssembler(manifest).add(nulls)
  with pytest.raises(BadWeightStream, match="weight stream columns"):
    read_manifest(pa.schema([("tensor", pa.int64())], metadata=schema.metadata))
  bad = schema.with_metadata({**schema.metadata, b"part": b"[0, 9]"})
  with pytest.raises(BadWeightStream, match=r"part \[0, 9\] is not a set of tensors of its manifest \(4\)"):
    read_manifest(bad)


def test_a_part_of_a_version_carries_the_whole_manifest_and_its_own_tensors():
  flat = _weights()
  manifest = manifest_of(flat)
  arrays = list(flat.values())
  got = {}
  for i in range(3):
    schema = weight_schema(7, manifest, part_indices(manifest, i, 3))
    version, seen, part = read_manifest(schema)
    assert version == 7 and seen == manifest and part == part_indices(manifest, i, 3)
    assembler = WeightAssembler(seen, part)
    for batch in weight_batches(schema, arrays, 8):
      assembler.add(batch)
    got.update(assembler.result())
  assert list(sorted(got)) == sorted(flat)
  for name in flat:
    np.testing.assert_array_equal(got[name], flat[name])


def test_weights_tickets_round_trip_and_bad_ones_name_the_problem():
  assert read_weights_ticket(weights_ticket(3, 1, 4)) == (3, 1, 4)
  assert read_weights_ticket(b'{"weights": 2}') == (2, 0, 1)
  for raw, match in [(b"[]", "bad weights ticket"), (b'{"weights": "x"}', "bad weights ticket"),
                     (weights_ticket(1, 4, 4), "part 4 of 4"), (weights_ticket(1, 0, 65), "part 0 of 65"),
                     (b"x" * 2000, "a ticket of 2000 bytes")]:
    with pytest.raises(ValueError, match=match):
      read_weights_ticket(raw)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 1000), max_size=30), st.integers(1, 5))
def test_weight_parts_cover_every_tensor_once_and_balance(nbytes, parts):
  split = partition_tensors(nbytes, parts)
  assert len(split) == parts and sorted(i for part in split for i in part) == list(range(len(nbytes)))
  loads = [sum(nbytes[i] for i in part) for part in split]
  assert max(loads) <= sum(nbytes) / parts + max(nbytes, default=0)  # LPT's bound


def test_control_messages_round_trip_and_are_checked():
  lease = Lease(lease_id=3, step=2, group_ids=(8, 9), prompts=("1+2=", "3+4="), predicted_lengths=(),
                length_quantiles=(1.0, 2.0), min_version=1, instances=2)
  reply = LeaseReply(lease=lease, finished=False)
  assert decode_message(encode_message(reply), LeaseReply) == reply
  report = StepReport(sampler_id=0, lease_id=3, step=2, generation_s=1.5, lengths=(3.0, 4.5), wait_s=0.0, samples=8,
                      instances=1, busy=((1.0, 2.5),))
  assert decode_message(encode_message(report)) == report
  assert decode_message(encode_message(Register("s", {"PipelineConfig.mode": "'async'"}))).settings == {
      "PipelineConfig.mode": "'async'"}
  body = json.loads(encode_message(report))
  cases = {"not JSON": b"\x80", "not a known control message": json.dumps({"@type": "Pickle"}).encode(),
           "unknown fields \\['extra'\\]": json.dumps({**body, "extra": 1}).encode(),
           "missing fields \\['step'\\]": json.dumps({k: v for k, v in body.items() if k != "step"}).encode(),
           "StepReport.samples must be int, got str": json.dumps({**body, "samples": "8"}).encode(),
           r"StepReport.busy\[0\] must have 2 entries": json.dumps({**body, "busy": [[1.0]]}).encode(),
           "expected a LeaseReply message, got StepReport": encode_message(report)}
  for problem, data in cases.items():
    with pytest.raises(BadMessage, match=problem):
      decode_message(data, LeaseReply if "LeaseReply" in problem else None)
  with pytest.raises(TypeError, match="not a control message"):
    encode_message(object())
