"""What a hostile or buggy sampler can send the trainer, refused at the door: the nine inputs of issue 23
(each a test that failed before), the minor ones, and the trainer that never stops over one shard."""

import dataclasses
import json
import time
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from streamrl_jax.message_codec import decode_message
from streamrl_jax.messages import BadMessage, BadShard, LeaseRequest, Published, Register
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.phase_clock import PhaseClock
from streamrl_jax.pipeline.trainer.step_intake import IntakeRules, IntakeState
from streamrl_jax.pipeline.trainer.worker import TRAINER_PHASES, TrainerCounters, TrainerWorker
from streamrl_jax.models import CharTokenizer
from streamrl_jax.streaming import SampleShard
from streamrl_jax.streaming.flight_server import SAMPLES_COMMAND
from streamrl_jax.streaming.sample_schema import (BadSampleBatch, SampleEnvelope, WireLimits,
                                                  batch_to_shard, shard_to_batch)
from streamrl_jax.tasks import ArithmeticTask
from tests.flight_setup import SETTINGS, leased_sender, serving
from streamrl_jax.pipeline.parts import controller_setup
from tests.wire_samples import VOCAB, _replace_column, group_shard

LIMITS = WireLimits(VOCAB, max_tokens=24, max_rows=8)
CONFIG = PipelineConfig(mode="async", steps=3, prompts_per_step=4, group_size=2, max_new_tokens=8)


def batch_of(shard: SampleShard, sampler_id: int = 0, seq: int = 0) -> pa.RecordBatch:
  return shard_to_batch(shard, SampleEnvelope(sampler_id, seq))


def whole(step: int, group_ids, lengths=(4, 5), seed=0) -> SampleShard:
  """Whole groups of `step` (group_size 2), concatenated."""
  return SampleShard.concat([group_shard(list(lengths), step=step, group=g, seed=seed + g) for g in group_ids])


def put_raw(connection, batch: pa.RecordBatch) -> dict:
  writer, reader = connection.client.do_put(flight.FlightDescriptor.for_command(SAMPLES_COMMAND), batch.schema,
                                            options=flight.FlightCallOptions(timeout=10))
  with writer:
    writer.write_batch(batch)
    writer.done_writing()
    return json.loads(reader.read().to_pybytes())


# ---- 1, 2, 3: what the codec refuses ------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), -float("inf"), float("inf"), -1e30, 5.0])
def test_1_nonfinite_or_impossible_logprobs_are_refused(value):
  shard = group_shard([4, 5])
  logprobs = shard.logprobs.copy()
  logprobs[1, 3] = value
  with pytest.raises(BadSampleBatch, match=r"row 1: logprobs must be finite and in \[-1000, 0\]"):
    batch_to_shard(batch_of(dataclasses.replace(shard, logprobs=logprobs)), LIMITS)
  rewards = shard.rewards.copy()
  rewards[0] = 1e30
  with pytest.raises(BadSampleBatch, match=r"row 0: reward must be finite, \|reward\| <= 1e\+06"):
    batch_to_shard(batch_of(dataclasses.replace(shard, rewards=rewards)), LIMITS)


@pytest.mark.parametrize("column", ["tokens", "loss_mask", "logprobs"])
def test_2_a_null_inside_a_list_is_refused(column):
  good = batch_of(group_shard([5, 6]))
  values = good.column(column).to_pylist()
  values[1][2] = None
  bad = _replace_column(good, column, pa.array(values, good.schema.field(column).type))
  with pytest.raises(BadSampleBatch, match=f"'{column}' holds 1 nulls inside its lists"):
    batch_to_shard(bad, LIMITS)


def test_3_samples_longer_or_more_than_the_run_allows_are_refused():
  with pytest.raises(BadSampleBatch, match="row 1: 30 tokens; this run's samples hold at most 24"):
    batch_to_shard(batch_of(group_shard([5, 30])), LIMITS)
  with pytest.raises(BadSampleBatch, match="9 rows; this run takes at most 8"):
    batch_to_shard(batch_of(group_shard([4] * 9)), LIMITS)
  run = WireLimits.of_run(CONFIG.sampler.engine, CONFIG.samples_per_step, VOCAB)
  assert (run.max_tokens, run.max_rows) == (CONFIG.sampler.engine.max_prompt_length + 8, 8)
  batch_to_shard(batch_of(group_shard([4, 24])), LIMITS)  # at the limit: taken


# ---- 4: the lease rules --------------------------------------------------------------------------
def two_samplers():
  controller = Controller(controller_setup(CONFIG), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0)
  a, b = (controller.register(Register(name, {})).sampler_id for name in ("a", "b"))
  controller.published(Published(0))
  leases = [controller.lease(LeaseRequest(s, 0.0)).lease for s in (a, b)]
  assert [lease.group_ids for lease in leases] == [(0, 1), (2, 3)]
  return controller, a, b


def test_4_shards_outside_the_senders_leases_or_not_whole_groups_are_refused():
  controller, a, b = two_samplers()  # messages name steps as metrics rows do: index 0 is step 1
  with pytest.raises(BadShard, match="group 2 of step 1 was never leased to sampler 'a'"):
    controller.door.on_shard(a, whole(0, [2]))  # b's
  with pytest.raises(BadShard, match="group 9 of step 3 was never leased to sampler 'a'"):
    controller.door.on_shard(a, whole(2, [9]))  # a future step nobody was leased
  with pytest.raises(BadShard, match=r"group 0 of step 1 carries sample indices \[0\]; a shard carries whole groups"):
    controller.door.on_shard(a, group_shard([4], step=0, group=0))
  twice = dataclasses.replace(whole(0, [0]), sample_indices=np.array([1, 1]))
  with pytest.raises(BadShard, match=r"sample indices \[1, 1\]"):
    controller.door.on_shard(a, twice)
  mixed = dataclasses.replace(whole(0, [0]), steps=np.array([0, 1]))
  with pytest.raises(BadShard, match=r"mixes steps \[1, 2\]"):
    controller.door.on_shard(a, mixed)
  assert controller.door.on_shard(a, whole(0, [0, 1])) == "accept"
  assert controller.door.on_shard(12345, whole(0, [0])) == "rejoin"
  controller.published(Published(1))  # step 0 is trained: a copy arriving now is not taken
  assert controller.door.on_shard(b, whole(0, [2])) == "trained"


def take_step(shards, step=1):
  """`TrainerWorker._take_step` on a stand-in worker that records what it would train."""
  trained = []
  worker = SimpleNamespace(config=CONFIG.trainer, shape=CONFIG.shape, spec=CONFIG.spec, streamed=CONFIG.spec.streamed,
                           rules=IntakeRules.of(CONFIG.shape), intake=IntakeState(),
                           refusals=[], phase_clock=PhaseClock(TRAINER_PHASES),
                           counters=TrainerCounters(), state=None,
                           updates=SimpleNamespace(begin=lambda state, before_update: None),  # a step's updates
                           _accumulate=lambda shard, step, clock: trained.append(shard))
  for name in ("_next_shard", "_applied", "_count_step"):  # the worker's own steps
    setattr(worker, name, getattr(TrainerWorker, name).__get__(worker))
  worker.stop, worker._progress = None, lambda what: None
  feed = iter(shards)
  TrainerWorker._take_step(worker, step, None, lambda timeout: next(feed), clock=time.monotonic)  # no controller needed
  return worker, sorted(k for s in trained for k in s.keys())


def test_4_the_trainer_takes_new_groups_beside_trained_ones_and_drops_the_rest_without_stopping():
  mixed_steps = dataclasses.replace(whole(1, [6]), steps=np.array([1, 2]))
  worker, trained = take_step([whole(1, [4]), whole(1, [4, 5]), whole(1, [99]), mixed_steps, whole(2, [8]),
                               whole(1, [6, 7])])
  assert trained == [(1, g, i) for g in (4, 5, 6, 7) for i in (0, 1)]  # each sample of the step once
  assert worker.counters["duplicate_samples"] == 2 and worker.counters["refused_samples"] == 4
  assert [s for s, _ in worker.intake.early] == [2]  # step 2's shard waits for its step
  assert "group 99" in worker.refusals[0] and "mixes samples of steps [2, 3]" in worker.refusals[1]


# ---- 5 and 8: memory and the queue over Flight ---------------------------------------------------
@pytest.fixture
def door():
  yield from serving(capacity=4)


def test_5_shards_of_far_off_steps_are_refused_and_hold_no_memory(door):
  server, controller, queue, _, connection = door
  sender = leased_sender(connection, controller)
  for seq in range(100):  # 400 samples of step 1, never leased (on-policy: step 1 waits for version 1)
    with pytest.raises(flight.FlightServerError, match="never leased to sampler 's'"):
      put_raw(connection, batch_of(whole(1, [4 + seq % 4, 4 + (seq + 1) % 4]), sender.sampler_id, seq))
  assert len(queue) == 0 and server.counters["bad_batches"] == 100
  assert controller.counters["refused_batches"] == 100
  sender.put(whole(0, [0]))  # the sender's own lease is still taken
  assert len(queue) == 2


def test_8_a_shard_bigger_than_the_queue_is_refused_by_name(door):
  server, controller, queue, _, connection = door
  sender = leased_sender(connection, controller)
  with pytest.raises(BadMessage, match=r"6 samples in one batch exceed the trainer's queue \(4 samples\)"):
    sender.put(whole(0, [0, 1, 2]))
  sender.put(whole(0, [0, 1]))
  assert len(queue) == 4


# ---- 6 and 7: control messages and tickets --------------------------------------------------------
@pytest.mark.parametrize("body", [b'{"@type":"VersionQuery","min_version":5,"wait_s":NaN}',
                                  b'{"@type":"LeaseRequest","sampler_id":1,"wait_s":Infinity}',
                                  b'{"@type":"LeaseRequest","sampler_id":1,"wait_s":1e999}',
                                  b'{"@type":"VersionQuery","min_version":5,"wait_s":1e9}'])
def test_6_waits_that_are_not_finite_or_not_bounded_are_refused_at_once(door, body):
  server, _, _, _, connection = door
  with pytest.raises(BadMessage, match="finite|must lie in"):
    decode_message(body)
  with pytest.raises(flight.FlightServerError, match="finite|must lie in"):  # answered: a wait would time out
    list(connection.client.do_action(flight.Action("control", body), options=flight.FlightCallOptions(timeout=10)))
  assert server.counters["bad_actions"] == 1


def test_7_a_ticket_asking_for_millions_of_parts_is_refused(door):
  server, _, _, store, connection = door
  store.publish({"w": jnp.ones((3,)), "b": jnp.zeros((2,))}, 0)
  store.wait()
  for ticket in ({"weights": 0, "part": 0, "parts": 10**7}, {"weights": 0, "part": 2, "parts": 2}, {"weights": [0]}):
    with pytest.raises(flight.FlightServerError, match="bad weights ticket"):
      connection.client.do_get(flight.Ticket(json.dumps(ticket).encode()),
                               options=flight.FlightCallOptions(timeout=10)).read_all()
  assert server.counters["bad_tickets"] == 3
  # a ticket in range is served: part 1 of 2 carries exactly that part's tensor, whole (of the manifest [b, w], by
  # name, the larger w goes to part 0 and b to part 1)
  part = connection.client.do_get(flight.Ticket(b'{"weights": 0, "part": 1, "parts": 2}')).read_all()
  assert json.loads(part.schema.metadata[b"part"]) == [0] and part.column("tensor").to_pylist() == [0]
  assert part.column("data")[0].as_py() == np.zeros((2,), np.float32).tobytes()


def test_refusals_quote_little_of_what_was_sent(door):
  _, _, _, _, connection = door
  body = json.dumps({"@type": "Register", "name": "x" * 100_000, "settings": {}}).encode()
  with pytest.raises(flight.FlightServerError) as refused:
    list(connection.client.do_action(flight.Action("control", body)))
  assert "Register.name has 100000 characters; at most 256" in str(refused.value)
  assert len(str(refused.value)) < 1000
  big = json.dumps({"@type": "Register", "name": "s", "settings": {"k": "x" * (5 << 20)}}).encode()
  with pytest.raises(flight.FlightError):  # over the codec's size, or gRPC's own message limit
    list(connection.client.do_action(flight.Action("control", big)))
  bad = batch_of(group_shard([4, 5]))
  bad = _replace_column(bad, "tokens", pa.array([[1, 2, 3, 10**6], [1, 2, 3, 4, 5]], pa.list_(pa.int32())))
  with pytest.raises(flight.FlightServerError, match=r"row 0: token ids"):
    put_raw(connection, bad)


def test_settings_of_another_run_are_quoted_briefly(door):
  _, controller, _, _, _ = door
  with pytest.raises(BadMessage) as refused:
    controller.register(Register("s", {**SETTINGS, "PipelineConfig.mode": "x" * 10_000}))
  assert "10002 characters" in str(refused.value) and len(str(refused.value)) < 600
