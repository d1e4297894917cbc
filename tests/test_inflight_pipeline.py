"""Weights updated in flight, the staleness bound per token, and dynamic sampling, through the in-process
pipeline on the tiny model (the same shapes as test_pipeline: no new compiles)."""

import dataclasses
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.messages import Ack, Backfill, Backfilled, Regenerate
from streamrl_jax.models import Transformer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.pipeline.controller.config import ControllerConfig
from streamrl_jax.sampling import SamplerConfig
from streamrl_jax.pipeline.step_plan import backfill_count, backfill_prompts, step_group_ids
from streamrl_jax.pipeline.trainer.step_intake import IntakeRules, refusal
from streamrl_jax.pipeline.trainer.step_intake import equal_reward_groups as _equal_reward_groups
from streamrl_jax.tasks import ArithmeticTask
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.pipeline.parts import controller_setup, sampler_setup, trainer_setup
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask, run
from tests.wire_samples import group_shard


class FirstDigitTask(ArithmeticTask):
  """Reward 1 when the completion starts with a digit: an untrained model gets it now and then, so some groups'
  rewards are all equal (all 0, or all 1) and others are not."""

  @staticmethod
  def reward(prompt: str, completion: str) -> float:
    return float(completion[:1].isdigit())


def backfilling(on: bool):
  """The controller's config with dynamic sampling `on`, adding up to 3 prompts to a step."""
  return dataclasses.replace(BASE.controller, dynamic_sampling=on, backfill_limit=3)


def run_first_digit(mode: str, checkpointer=None, resume=False, **overrides):
  config = dataclasses.replace(BASE, mode=mode, **overrides)
  return run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, FirstDigitTask(max_digits=3),
                      hooks=RunHooks(checkpointer, resume))


def overlapping(intervals) -> int:
  """How many consecutive (start, end) intervals, in start order, overlap the one before."""
  spans = sorted(intervals)
  return sum(b[0] < a[1] for a, b in zip(spans, spans[1:]))


@pytest.fixture(scope="module")
def in_flight():
  return {cache: run("async", sampler=dataclasses.replace(BASE.sampler, in_flight=True,
                                                          in_flight_cache=cache)) for cache in ("keep", "recompute")}


@pytest.mark.parametrize("cache", ["keep", "recompute"])
def test_in_flight_trains_every_sample_once_and_overlaps_leases(in_flight, cache):
  result = in_flight[cache]
  counters = result.counters
  assert counters["samples_generated"] == counters["samples_trained"] == 3 * 16 == counters["unique_samples_trained"]
  assert counters["stale_samples"] == counters["groups_regenerated"] == 0
  assert [m["step"] for m in result.metrics] == [1, 2, 3]
  assert all(m["staleness_max"] <= BASE.staleness for m in result.metrics)  # per trained token
  assert max(m["staleness_max"] for m in result.metrics) == 1
  # the next lease starts while the last one's rows still run
  (busy,) = [spans for name, spans in result.timeline.items() if name.startswith("sampler")]
  assert overlapping([(b, e) for b, e, _ in busy]) >= 1


def test_between_samples_never_overlaps_leases():
  result = run("async", steps=3)
  (busy,) = [spans for name, spans in result.timeline.items() if name.startswith("sampler")]
  assert overlapping([(b, e) for b, e, _ in busy]) == 0


def test_in_flight_is_refused_where_no_update_can_be_taken_in_flight():
  for mode in ("colocated", "disaggregated", "stream"):
    with pytest.raises(ValueError, match="in_flight needs mode='async'"):
      PipelineConfig(mode=mode, sampler=SamplerConfig(in_flight=True))
  with pytest.raises(ValueError, match="in_flight_cache='drop'"):
    PipelineConfig(sampler=SamplerConfig(in_flight_cache="drop"))
  with pytest.raises(ValueError, match="backfill_limit must be >= 0"):
    PipelineConfig(controller=ControllerConfig(backfill_limit=-1))


@pytest.fixture(scope="module")
def dynamic():
  return {on: run_first_digit("async", controller=backfilling(on)) for on in (False, True)}


def test_dynamic_sampling_trains_no_equal_reward_group_and_fills_the_step(dynamic):
  plain, filtered = dynamic[False], dynamic[True]
  assert sum(m["equal_reward_groups_trained"] for m in plain.metrics) > 0  # the task does make such groups
  assert sum(m["groups_filtered"] for m in plain.metrics) == 0
  metrics = filtered.metrics
  assert all(m["equal_reward_groups_trained"] == 0 for m in metrics)
  assert sum(m["groups_filtered"] for m in metrics) > 0 and sum(m["groups_backfilled"] for m in metrics) > 0
  for m in metrics:
    assert m["groups_backfilled"] == backfill_count(filtered_config().shape, 0, m["groups_filtered"])
    assert m["prompts_leased"] == 4 + m["groups_backfilled"]
  counters = filtered.counters
  trained_groups = sum(4 + m["groups_backfilled"] - m["groups_filtered"] for m in metrics)
  assert counters["samples_trained"] == trained_groups * 4 == counters["unique_samples_trained"]
  assert counters["prompts_submitted"] == sum(m["prompts_leased"] for m in metrics)
  assert counters["prompts_backfilled"] == sum(m["groups_backfilled"] for m in metrics)


def filtered_config() -> PipelineConfig:
  return dataclasses.replace(BASE, controller=backfilling(True))


def test_dynamic_sampling_resumes_exactly_and_filters_alike_in_colocated_mode(tmp_path):
  from streamrl_jax.training.checkpoint import Checkpointer
  whole = run_first_digit("stream", controller=backfilling(True))
  colocated = run_first_digit("colocated", controller=backfilling(True))  # on-policy: the same groups
  counts = lambda result: [(m["groups_filtered"], m["groups_backfilled"], m["equal_reward_groups_trained"])  # noqa: E731
                           for m in result.metrics]
  assert counts(colocated) == counts(whole) and sum(f for f, _, _ in counts(whole)) > 0
  checkpointer = Checkpointer(tmp_path, max_to_keep=2)
  run_first_digit("stream", checkpointer=checkpointer, controller=backfilling(True), steps=2)
  resumed = run_first_digit("stream", checkpointer=checkpointer, resume=True, controller=backfilling(True))
  assert [m["step"] for m in resumed.metrics] == [3]
  last, again = whole.metrics[-1], resumed.metrics[0]
  for key in ("groups_filtered", "groups_backfilled", "prompts_leased", "reward_mean"):
    assert again[key] == last[key], key
  for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_backfill_prompts_and_ids_are_fixed_by_seed_and_step():
  config, task = filtered_config().shape, DigitTask(max_digits=3)
  assert backfill_prompts(config, task, 2, 0, 3) == backfill_prompts(config, task, 2, 0, 1) + \
      backfill_prompts(config, task, 2, 1, 2)
  assert backfill_prompts(config, task, 2, 0, 3) != backfill_prompts(config, task, 1, 0, 3)
  planned, extra = step_group_ids(config, 1)
  assert list(planned) == [7, 8, 9, 10] and list(extra) == [11, 12, 13]
  assert step_group_ids(dataclasses.replace(config, steps=50), 1) == (planned, extra)  # whatever the run's length
  assert [backfill_count(config, used, 2) for used in range(5)] == [2, 2, 1, 0, 0]
  assert step_group_ids(BASE.shape, 1)[1] == range(12, 12)  # off: no backfill ids


def test_the_trainer_refuses_groups_outside_the_plan_naming_the_backfill_range():
  shard = group_shard([5, 6], step=1, group=20)
  assert "backfill groups 11..13" in refusal(shard, IntakeRules.of(filtered_config().shape))
  assert refusal(group_shard([5, 6], step=1, group=12), IntakeRules.of(filtered_config().shape)) is None
  assert "groups 4..7, indices" in refusal(group_shard([5, 6], step=1, group=12), IntakeRules.of(BASE.shape))


def test_equal_reward_groups_by_hand():
  shard = group_shard([5, 6, 5, 6], group=3)
  shard = dataclasses.replace(shard, group_ids=np.asarray([3, 3, 8, 8]), rewards=np.asarray([1.0, 1.0, 0.0, 0.5]))
  assert _equal_reward_groups(shard) == [3]


class _Recorder:
  """The controller as the trainer worker sees it, recording what it is asked."""

  def __init__(self):
    self.regenerated, self.backfills = [], []

  def regenerate(self, message: Regenerate) -> Ack:
    self.regenerated.append((message.step, list(message.group_ids)))
    return Ack()

  def backfill(self, message: Backfill) -> Backfilled:
    self.backfills.append((message.step, list(message.filtered)))
    return Backfilled(0)


def test_a_group_with_a_token_past_the_staleness_bound_is_generated_again():
  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.pipeline.trainer.worker import TrainerWorker
  config = dataclasses.replace(BASE, mode="async").resolved("float32")  # step 2 takes tokens of version 1 or newer
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  worker = TrainerWorker(trainer_setup(config), graphdef, params,
                         mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1)))

  def group(g, oldest):
    shard = group_shard([9, 10, 11, 12], step=2, group=g)
    versions = np.where(shard.loss_mask, np.where(np.arange(shard.tokens.shape[1])[None] > 2, 2, oldest), 0)
    return dataclasses.replace(shard, tokens=shard.tokens % MODEL.vocab_size, versions=versions,
                               first_versions=np.full(4, oldest), last_versions=np.full(4, 2))

  arriving = [group(8, 0), group(9, 1), group(10, 1), group(8, 1), group(11, 2)]
  recorder = _Recorder()
  shards, _, _ = worker._take_step(2, recorder, lambda timeout: arriving.pop(0), clock=lambda: 0.0)
  assert recorder.regenerated == [(2, [8])] and not arriving  # its second copy, within the bound, is trained
  assert sorted(int(s.group_ids[0]) for s in shards) == [8, 9, 10, 11]
  assert worker.counters["groups_regenerated"] == 1 and worker.counters["samples_trained"] == 16
  counts = [s.staleness_sum_max(2) for s in shards]  # (tokens, their staleness summed, the most)
  assert max(c[2] for c in counts) == 1 and 0 < sum(c[1] for c in counts) < sum(c[0] for c in counts)


class _StepControl(_Recorder):
  """The controller as `_train_step` sees it: no samplers to summarise."""

  def __init__(self):
    super().__init__()
    self.published_versions = []

  def step_trained(self, message):
    from streamrl_jax.messages import StepSummary
    return StepSummary(0.0, 1, 1, 0.0, {})

  def published(self, message):
    self.published_versions.append(message.version)

  def sampler_wait(self, query):
    from streamrl_jax.messages import SamplerWait
    return SamplerWait(0.0)


class _Publisher:
  def __init__(self):
    self.seconds, self.versions = {}, []

  def publish(self, params, version):
    self.versions.append(version)


@pytest.mark.parametrize("mode", ["stream", "disaggregated"])  # accumulated as it arrives, or gathered first
def test_a_step_whose_samples_hold_no_token_to_train_is_counted_and_skipped(mode, capsys):
  """Every completion empty (every episode failed): the step leaves the weights and optimizer as they were, says
  so in a warning line and its metrics row, and the next step trains as usual."""
  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.pipeline.trainer.worker import TrainerWorker
  from streamrl_jax.records.metric_table import join_row
  config = dataclasses.replace(BASE, mode=mode, steps=2).resolved("float32")
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  worker = TrainerWorker(trainer_setup(config), graphdef, params,
                         mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1)))

  def group(step, g, empty):
    shard = group_shard([9, 10, 11, 12], step=step, group=g)
    mask = np.zeros_like(shard.loss_mask) if empty else shard.loss_mask
    return dataclasses.replace(shard, tokens=shard.tokens % MODEL.vocab_size, loss_mask=mask,
                               versions=np.where(mask, step, 0), first_versions=np.full(4, step),
                               last_versions=np.full(4, step))
  before = jax.device_get(worker.state.params)
  control, weights = _StepControl(), _Publisher()
  arriving = [group(0, g, empty=True) for g in range(4)]
  parts, _ = worker._train_step(0, control, lambda timeout: arriving.pop(0), weights, lambda: 0.0, 0.0)
  row = join_row(parts)  # the step's row as `_finish_step` joins it
  assert "warning: step 1: its 16 samples hold no token to train" in capsys.readouterr().err
  assert row["empty_step"] == 1.0 and row["update_skipped"] == 1.0 and worker.counters["empty_steps"] == 1
  assert all(np.isfinite(v) for v in row.values() if isinstance(v, float)) and row["staleness_max"] == 0
  assert int(worker.state.step) == 0 and not worker.batcher.pending_rows and weights.versions == [1]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(worker.state.params), before)
  arriving = [group(1, g, empty=g == 4) for g in range(4, 8)]  # the next step trains, its empty group adds nothing
  row = join_row(worker._train_step(1, control, lambda timeout: arriving.pop(0), weights, lambda: 0.0, 0.0)[0])
  assert row["empty_step"] == 0.0 and "update_skipped" not in row and int(worker.state.step) == 1
  assert row["tokens"] == sum(int(group(1, g, g == 4).loss_mask.sum()) for g in range(4, 8))
  assert worker.counters["empty_steps"] == 1
  assert weights.versions == [1] and control.published_versions == [1, 2]  # the last step's weights go to no sampler


class _Weights:
  """A weight source holding one version."""

  def __init__(self, params):
    from streamrl_jax.messages import WeightUpdate
    self.update = WeightUpdate(0, params)

  def latest(self):
    return self.update

  def wait_for(self, version, timeout):
    return self.update


class _Sink:
  """The sample transport as the trainer's door is: the controller hears of each shard; keeps them; sets `stop`
  once `stop_after` have come."""

  def __init__(self, controller, worker, stop_after):
    import threading
    self.controller, self.worker, self.stop_after = controller, worker, stop_after
    self.shards, self.stop = [], threading.Event()

  def put(self, shard):
    assert self.controller.door.on_shard(self.worker.sampler_id, shard) == "accept"
    self.shards.append(shard)
    if self.stop is not None and len(self.shards) >= self.stop_after:
      self.stop.set()


@pytest.fixture(scope="module")
def worker_parts():
  from streamrl_jax.pipeline.sampler.worker import SamplerWorker
  config = dataclasses.replace(BASE, steps=1)
  model = Transformer(MODEL, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))

  def make():
    worker = SamplerWorker(sampler_setup(config), graphdef, MODEL, TOKENIZER, DigitTask(max_digits=3), mesh)
    worker.weights = _Weights(params)
    return worker
  return make


def test_a_lease_handed_back_mid_generation_is_resumed_elsewhere_as_if_never_interrupted(worker_parts):
  from streamrl_jax.messages import Leave, Published
  from streamrl_jax.pipeline.controller import Controller
  config = dataclasses.replace(BASE, steps=1)
  reference = worker_parts()
  controller = Controller(controller_setup(config), DigitTask(max_digits=3), TOKENIZER, start_step=0)
  controller.published(Published(0))
  reference.register(controller)
  whole = _Sink(controller, reference, 4)  # stops after the step's 4 groups
  reference.serve(controller, whole, reference.weights, whole.stop)

  controller = Controller(controller_setup(config), DigitTask(max_digits=3), TOKENIZER, start_step=0)
  controller.published(Published(0))
  first, second = worker_parts(), worker_parts()
  first.register(controller)
  early = _Sink(controller, first, 1)  # leaves once its first group is out: the others are begun
  assert first.serve(controller, early, first.weights, early.stop) == "stopped"
  handed = controller.counters["partial_samples_handed_back"]
  assert handed >= 4  # samples of 3 groups were running or finished
  second.register(controller)
  rest = _Sink(controller, second, 3)
  second.serve(controller, rest, second.weights, rest.stop)
  assert 0 < second.sampler.counters["resumed_partial"] <= handed
  got = {k: (s.tokens[r], s.logprobs[r]) for s in early.shards + rest.shards
         for r, k in enumerate(s.keys())}
  want = {k: (s.tokens[r], s.logprobs[r]) for s in whole.shards for r, k in enumerate(s.keys())}
  assert sorted(got) == sorted(want) and len(want) == 16  # every sample once
  for key in want:  # the same tokens and log-probabilities as a generation never interrupted
    np.testing.assert_array_equal(got[key][0], want[key][0])
    np.testing.assert_allclose(got[key][1], want[key][1], atol=2e-5)
  # bad partials refuse the whole Leave, naming the sample
  third = worker_parts()
  third.register(controller)
  from streamrl_jax.message_codec import decode_message, encode_message
  from streamrl_jax.messages import BadMessage
  from streamrl_jax.types import Rollout
  with pytest.raises(BadMessage, match="group 99, which is not of a lease it holds"):
    controller.leave(Leave(third.sampler_id, partials=(Rollout(99, 0, (1,), (-1.0,), (0,)),)))
  with pytest.raises(ValueError, match="one of each per token"):
    Rollout(1, 0, (1, 2), (-1.0,), (0, 0))
  sent = encode_message(Leave(third.sampler_id, partials=(Rollout(1, 0, (1,), (-1.0,), (0,)),)))
  with pytest.raises(BadMessage, match="Rollout: .*one of each per token"):  # the same rule at the door
    decode_message(sent.replace(b'"logprobs":[-1.0]', b'"logprobs":[-1.0,-2.0]'))


class _BeatsDuringLeave:
  """The control channel, the controller itself, noting each call: a Leave waits up to 1 s for a heartbeat, which a
  beat thread still running at period 0.01 s sends (the trainer's shutdown, on every sampler's Leave, would cut it).
  Its beats never carry the run's end, so a lease reply does (the run ended between two beats)."""

  def __init__(self, controller):
    self.controller, self.calls, self.beat = controller, [], threading.Event()

  def __getattr__(self, name):
    return getattr(self.controller, name)

  def heartbeat(self, message, abort=None):
    self.calls.append("heartbeat")
    self.beat.set()
    return dataclasses.replace(self.controller.heartbeat(message), stop=False)

  def leave(self, message):
    self.beat.clear()
    self.calls.append("leave")
    self.beat.wait(1.0)
    return self.controller.leave(message)


class _HeldWeights(_Weights):
  """A receiver as a session closes it."""

  stats = {"fetches": 0}

  def close(self):
    pass


class _FinishingSink(_Sink):
  """Ends the run, as the trainer does after its last step, once the first shard is in: the sampler hears it at its
  next lease request, with `stop` never set."""

  def put(self, shard):
    assert self.controller.door.on_shard(self.worker.sampler_id, shard) == "accept"
    self.shards.append(shard)
    self.controller.finish()


def test_a_sessions_heartbeat_has_stopped_before_its_leave(worker_parts):
  """The trainer shuts its server down once every sampler has left, cancelling the calls under way: a heartbeat
  sent after the Leave ended its sampler with FlightCancelledError (CI, test_faults' resumed-trainer run)."""
  from collections import defaultdict

  from streamrl_jax.messages import Published
  from streamrl_jax.pipeline.controller import Controller
  from streamrl_jax.pipeline.sampler.program import _session
  config = dataclasses.replace(BASE, steps=1)
  worker = worker_parts()
  controller = Controller(controller_setup(config), DigitTask(max_digits=3), TOKENIZER, start_step=0)
  controller.published(Published(0))
  control = _BeatsDuringLeave(controller)
  worker.register(controller)
  sink = _FinishingSink(controller, worker, 1)
  outcome = _session(worker, control, sink, _HeldWeights(worker.weights.update.params), worker.sampler_id, 0.01,
                     sink.stop, defaultdict(int))
  assert outcome == "finished" and "heartbeat" in control.calls and control.calls[-1] == "leave", control.calls[-3:]


def test_partials_a_leaving_sampler_may_hand_back_by_hand():
  from streamrl_jax.pipeline.step_plan import partial_problem
  from streamrl_jax.types import Rollout
  config = BASE.shape  # group_size 4, max_new_tokens 12

  def p(group=5, index=0, n=3, finished=False):
    return Rollout(group, index, (1,) * n, (-1.0,) * n, (0,) * n, finished=finished)
  assert partial_problem(config, {5, 6}, [p(), p(index=1), p(6, 3, 12, finished=True)]) is None
  assert partial_problem(config, {5}, [p(), p(group=7)]) == "sample 0 of group 7, which is not of a lease it holds"
  assert "which is not in the group" in partial_problem(config, {5}, [p(index=4)])
  assert "which is there twice" in partial_problem(config, {5}, [p(), p()])
  assert "more than max_new_tokens=12" in partial_problem(config, {5}, [p(n=12)])  # unfinished: nothing to resume
  assert "more than max_new_tokens=12" in partial_problem(config, {5}, [p(n=13, finished=True)])
