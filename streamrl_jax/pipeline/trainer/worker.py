"""The trainer worker: trains each step on its samples as they arrive, publishes the new weights, checkpoints.

It owns the trainer state, the micro-batcher, the checkpointer and its counters; it reaches the rest of the
run through a shard source (`get`), a weight publisher (`publish`) and the controller (the version gate,
the samplers' step summaries, the instance target), asked by typed messages (`trainer.control.TrainerControl`).
What of each arriving shard a step trains is the step intake's decision (`step_intake.take`, pure): samples are
keyed by (step, group, sample index), and one trained already is dropped and counted (`duplicate_samples`), never
trained twice; samples of a later step wait for their step; a shard the step's plan does not hold, or one mixing
steps, is dropped and counted (`refused_samples`), never a reason to stop (across processes the Flight server's
door refuses such shards before they are acknowledged, so the counter stays 0 there); a group with a token older
than the staleness bound (step - max_lag) is leased again (`groups_regenerated`); with dynamic sampling, a group
whose rewards are all equal is not trained and the controller adds prompts in its place, up to the backfill
bound. The worker carries each decision out.

A stop request (`stopping.StopRequest`: the first Ctrl-C or SIGTERM) is honoured at a step boundary: the step
in progress finishes through its metrics row and its committed checkpoint, then `run` raises `RunStopped`. A
step still waiting for samples `WaitConfig.stop_grace_s` after the request is abandoned instead (the
checkpoint before it stays the one a resume starts from). Fault points (`faults.py`) mark the boundary's parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

from streamrl_jax import launch
from streamrl_jax.counters import Counters
from streamrl_jax.faults import FaultPoints
from streamrl_jax.host_memory import release_free_memory
from streamrl_jax.models.precision import SamplerPrecision, wire_bytes, wire_template
from streamrl_jax.messages import (Backfill, Published, Regenerate, SamplerWaitQuery, StepSkipped, StepTrained,
                                   row_step)
from streamrl_jax.phase_clock import PhaseClock
from streamrl_jax.pipeline.trainer.control import TrainerControl
from streamrl_jax.pipeline.trainer.policy import make_flow, make_trainer, merged_policy, packing, precompile
from streamrl_jax.pipeline.trainer.step_intake import IntakeRules, IntakeState, Taken, backfilled, begin, take
from streamrl_jax.pipeline.trainer.updates import StepUpdates, check_updates
from streamrl_jax.pipeline.trainer.step_row import Arrivals, StepTimes, batch_metrics, phase_row, step_parts
from streamrl_jax.records.metric_table import STEP, join_row
from streamrl_jax.pipeline.watchdog import StallWatch
from streamrl_jax.run_shape import RunShape
from streamrl_jax.stopping import RunStopped, StopRequest
from streamrl_jax.streaming import SampleShard
from streamrl_jax.training import MicroBatcher, TrainerConfig
from streamrl_jax.workflow.config import WorkflowConfig
from streamrl_jax.workflow.flow import shard_fields

_log = logging.getLogger(__name__)

SHARD_POLL_S = 1.0  # how often a trainer waiting for samples looks at a stop request
# Where the training thread's seconds go: waiting for samples, forward and backward passes (advantages and the
# reference's log-probabilities included), the optimizer update, publishing weights, writing the metrics row (its
# callbacks: held-out evaluation, TensorBoard), saving the checkpoint; the rest is "other".
TRAINER_PHASES = ("wait_samples", "forward_backward", "optimizer", "weight_send", "row", "checkpoint")


def _agreed(stop: bool) -> bool:
  """Process 0's stop request, the same on every trainer process (a step's checkpoint and the stop after it are taken
  by all together; a process that went on to the next step's shards while process 0 saved would mismatch its
  collectives). Other processes hold no stop request: only process 0 is asked."""
  if jax.process_count() == 1:
    return stop
  every = launch.launcher(jax.devices())  # multihost_utils' collectives run over every device
  return bool(every(multihost_utils.broadcast_one_to_all, np.int32(stop)))


@dataclasses.dataclass(frozen=True)
class TrainerSetup:
  """What a trainer worker is built from: its own config, the run's shape, and what it reads of the other parts'
  configs (set where the parts are built)."""

  trainer: TrainerConfig  # the trainer's own config
  shape: RunShape  # the run's shape
  precision: SamplerPrecision  # the weights' precision for the samplers (the bytes of one version on the wire)
  expert_axis: str  # the mesh's expert axis (`MeshConfig.expert_axis`)
  cache_length: int  # the sampler engine's cache length: the sample width `TrainerConfig.precompile` compiles
  workflow: WorkflowConfig = WorkflowConfig()  # the run's step graph: the trainer runs the stages bound to its pools
  pools: Mapping[str, Mesh] = dataclasses.field(default_factory=dict)  # the run's own pools' meshes (`pool_meshes`)
  tokenizer: object = None  # the policy's: a judge stage's question is encoded with it
  scorer_tls: object = None  # the TLS files (`TLSFiles`) the trainer reaches scorer programs with (None: plain)

  @property
  def pool_devices(self) -> int:
    """The devices the run's own pools take."""
    return sum(mesh.devices.size for mesh in self.pools.values())


class TrainerWorker:
  """Steps from `start_step` to `shape.steps`; `run` returns the per-step metrics."""

  def __init__(self, setup: TrainerSetup, graphdef, params, mesh, *, checkpointer=None, resume: bool = False,
               stop: StopRequest | None = None, streamed: bool | None = None):
    self.setup, self.config, self.shape, self.stop = setup, setup.trainer, setup.shape, stop  # config: the trainer's
    self.spec = self.shape.spec
    # streamed: each shard is accumulated as it arrives (the mode's choice); a follower arm gathers its step first,
    # so that a step it skips midway leaves nothing behind
    self.streamed = self.spec.streamed if streamed is None else streamed
    self.faults = FaultPoints.of_trainer_process(jax.process_index(), stop)
    self.lora = self.config.lora if self.config.lora.enabled else None
    self.trainer, trained = make_trainer(self.config, self.shape, setup.expert_axis, graphdef, params, mesh, resume)
    # the stages of the step graph on its mesh and the run's own `pools` (name -> mesh): a shard's advantages
    self.flow = make_flow(setup, self.trainer, nnx.merge(graphdef, params).config, params, mesh)
    self.state = self.trainer.init_state(trained, seed=self.shape.seed)
    self.state, self.start_step = _restored(self.state, checkpointer, self.flow.learners) if resume else (self.state, 0)
    self.checkpointer = checkpointer
    packed = packing(self.config, self.shape, graphdef, params, mesh) if self.config.packing else {}
    self.batcher = MicroBatcher(self.trainer, chunk_rows=self.config.chunk_rows, **packed)
    check_updates(self.config, jax.process_count(), self.flow.learners)
    self.phase_clock = PhaseClock(TRAINER_PHASES)  # the training thread's seconds, by phase: each row carries them
    self.updates = StepUpdates(self.trainer, self.batcher, self.config, self.shape.prompts_per_step, self.phase_clock)
    # with the bytes of one weight version on the wire (sent in the samplers' precision)
    self.counters = TrainerCounters(weight_version_bytes=wire_bytes(wire_template(
        self.state.params, setup.precision.on_trainer.precision)))
    self.refusals: list[str] = []  # why each refused shard was refused
    self.timeline: dict[str, list] = {"trainer": [], "sync": []}
    self.rules, self.intake = IntakeRules.of(self.shape), IntakeState()  # what it does with each arriving shard
    self._progress: Callable[[str], None] = lambda what: None  # marks progress for the stall watch (run)
    self._step_counts = StepCounts()  # counters of the step being trained, added to `counters` once it is (a step cut
    # short by a stop leaves no count behind: its samples are trained again after a resume)

  def policy_params(self):
    """The policy's parameters as a plain model's: the state's, or with LoRA the base with the adapters merged."""
    return merged_policy(self.trainer, self.state.params, self.lora)

  def run(self, controller: TrainerControl, get_shard: Callable[[float], SampleShard], weights, *,
          clock: Callable[[], float], on_step: Callable[[dict], None] | None = None,
          aux: Callable[[], dict] | None = None, row_parts: tuple[Callable[[dict], dict], ...] = (),
          skip: Callable[[int], str | None] | None = None) -> list[dict]:
    """Publishes the start version, then trains every step. `get_shard(timeout)`: the next shard (TimeoutError if
    none); `aux()`: extra state to checkpoint; `row_parts`: each `part(row)` adds its part of each row (`join_row`:
    memory and queue depth, held-out accuracy, an arm's keys), given the row so far; `on_step(row)` then sees it. A
    follower arm's `skip(step)` says why it skips a step (None: it trains it); its `get_shard` may raise
    `StepSkipped`."""
    if self.config.precompile:
      self.state = precompile(self.trainer, self.batcher, self.state, self.config.chunk_rows, self.setup.cache_length)
    weights.publish(self.state.params, self.start_step)
    controller.published(Published(self.start_step))
    release_free_memory()  # the holes that loading and placing the weights left in the heap, before the first step
    self.phase_clock.take()  # the first row's seconds begin here (compiles of the first step included)
    wait = self.config.wait
    watch = StallWatch(wait.step_timeout_s, _log.error, time.monotonic) if wait.step_timeout_s else None
    self._progress = watch.progress if watch is not None else self._progress
    with watch or contextlib.nullcontext(), self.stop.deferred() if self.stop else contextlib.nullcontext():
      metrics, last_end = [], clock()
      for step in range(self.start_step, self.shape.steps):
        if skip is not None and skip(step) is not None:
          continue
        try:
          parts, last_end = self._train_step(step, controller, get_shard, weights, clock, last_end)
        except StepSkipped:
          if skip is None:
            raise
          continue
        metrics.append(self._finish_step(step, parts, controller, on_step, aux, row_parts))
      return metrics

  def _train_step(self, step: int, controller: TrainerControl, get_shard, weights, clock,
                  last_end: float) -> tuple[dict, float]:
    """Takes the step's shards, trains on them and publishes the new weights; returns the step's metrics row's
    parts (`step_parts`) and the time it ended."""
    first_entry = len(self.timeline["trainer"])
    before = dict(self.batcher.counters)
    shards, waited, received = self._take_step(step, controller, get_shard, clock)
    begin = clock()
    empty = _drop_empty_step(self.batcher, shards, step)
    self.counters.empty_steps += empty
    with self.phase_clock.phase("forward_backward"):  # what is still pending, later passes; the updates are "optimizer"
      self.state, record = self.updates.end(self.state)
    updated, save_wait, train_metrics = bool(record.metrics), record.waited_s, record.row()
    if updated:
      with self.phase_clock.phase("optimizer"):  # a learning stage's (a critic)
        train_metrics.update(self.flow.end_step())
    else:  # nothing to train, or dynamic sampling filtered every group and nothing was left to backfill: no update
      if not empty:
        _warn(f"step {row_step(step)}: dynamic sampling filtered every group (equal rewards in each) and nothing was "
              "left to backfill; the step is skipped, the weights unchanged")
    own = {"empty_step": float(bool(empty)), **({} if updated else {"update_skipped": 1.0}),
           **self._step_counts.stage_means()}
    self._progress(f"the update of step {row_step(step)}")
    self.timeline["trainer"].append((begin, clock(), f"update {step}"))
    # this step's accumulate + update, not the wait for the last step's save
    train_s = sum(e - b for b, e, _ in self.timeline["trainer"][first_entry:]) - save_wait
    own.update(batch_metrics(before, self.batcher.counters))
    summary = controller.step_trained(StepTrained(step, train_s))  # before the weights go out: the next instance target
    sync_start = clock()
    if step + 1 < self.shape.steps:  # the last step's weights go to no sampler: no step is left to sample
      with self.phase_clock.phase("weight_send"):
        weights.publish(self.state.params, step + 1)
    self.faults.hit("publish", step + 1)
    if not self.spec.shared_mesh:
      controller.published(Published(step + 1))
    self.timeline["sync"].append((sync_start, sync_start, f"v{step + 1}"))
    self.counters.trainer_wait_s += waited
    end = clock()
    sampler_idle = controller.sampler_wait(SamplerWaitQuery()).seconds / max(end, 1e-9)
    times = StepTimes(waited, end - last_end, train_s, sampler_idle, weights.seconds)
    return step_parts(self.shape, step, shards, received, train_metrics, own, times, summary), end

  def _await_checkpoint(self, clock) -> float:
    """Waits until the last step's save (in the background) has read what the update will donate; its seconds."""
    if self.checkpointer is None:
      return 0.0
    start = clock()
    with self.phase_clock.phase("checkpoint"):
      self.checkpointer.wait()
    return clock() - start

  def _finish_step(self, step: int, parts: dict, controller: TrainerControl, on_step, aux, more) -> dict:
    """The step's metrics row, joined from its parts and those `more` adds, then its checkpoint; a stop request ends
    the run here (`RunStopped`)."""
    row = join_row({**parts, STEP: {**parts[STEP], **phase_row(self.phase_clock.take())}})
    with self.phase_clock.phase("row"):  # (a held-out evaluation when due is a part: its seconds are the row's)
      for part in more:
        row = join_row(part(row), row)
      if on_step is not None:
        on_step(row)
    self.faults.hit("row", step + 1)
    stopping = _agreed(self.stop is not None and self.stop.requested)
    if self.checkpointer is not None and self.checkpointer.due(step + 1, step + 1 == self.shape.steps or stopping):
      # after the step's metrics row: a resume never lacks a trained step's row; numbered by RL step (a step whose
      # groups dynamic sampling all filtered makes no optimizer step)
      with self.phase_clock.phase("checkpoint"):
        self.checkpointer.save(self.state, extra={"next_step": step + 1}, aux=aux() if aux else None, step=step + 1,
                               others={name: learner.state for name, learner in self.flow.learners.items()})
      self.faults.hit("save", step + 1)
    release_free_memory()
    self._progress(f"the end of step {row_step(step)}")
    if self.spec.shared_mesh:  # the sampler's next step (it needs this version) takes the mesh once we are done
      controller.published(Published(step + 1))
    if (stopping or _agreed(self.stop is not None and self.stop.requested)) and step + 1 < self.shape.steps:
      raise self._stopped()  # asked before the step's end, or during its save
    return row

  def _stopped(self, abandoned_step: int | None = None) -> RunStopped:
    """The stop, once the last checkpoint has committed."""
    if self.checkpointer is None:
      return RunStopped(None, abandoned_step)
    self.checkpointer.wait()
    return RunStopped(self.checkpointer.latest_step(), abandoned_step)

  def _next_shard(self, get_shard, step: int) -> SampleShard:
    """The next shard from `get_shard(timeout)`; a step still waiting `stop_grace_s` after a stop request is
    abandoned (RunStopped)."""
    while True:
      try:
        shard = get_shard(SHARD_POLL_S)
        self._progress(f"a shard of step {row_step(step)} arrived")
        return shard
      except TimeoutError:
        if self.stop is not None and self.stop.overdue(self.config.wait.stop_grace_s):
          raise self._stopped(abandoned_step=row_step(step)) from None

  def _take_step(self, step: int, controller: TrainerControl, get_shard, clock) -> tuple[list, float, dict]:
    """Shards of one global batch, as the step intake decides (`step_intake.take`); streamed modes accumulate each
    on arrival. Returns (shards trained, wait s, what arrived: rewards of every group, trained or not, and the
    groups filtered and backfilled)."""
    shards, waited = [], 0.0
    received = Arrivals()
    self._step_counts = StepCounts()
    self.updates.begin(self.state, lambda: self._await_checkpoint(clock))
    self.intake, early = begin(self.intake, self.rules, step)
    while self.intake.needed > 0:
      if early:
        shard = early.pop(0)
      else:
        start = time.perf_counter()
        with self.phase_clock.phase("wait_samples"):
          shard = self._next_shard(get_shard, step)
        waited += time.perf_counter() - start
      self.intake, taken = take(self.intake, self.rules, shard)
      shard = self._applied(taken, shard, step, controller, received)
      if shard is None:
        continue
      shards.append(shard)
      if self.streamed:
        self._accumulate(shard, step, clock)
    self._count_step(shards, received)
    if not self.streamed:
      for shard in shards:
        self._accumulate(shard, step, clock)
    self.counters.samples_trained += self._step_counts.samples_trained  # the step taken whole: the run's counts
    self.counters.stale_samples += self._step_counts.stale_samples
    return shards, waited, received

  def _applied(self, taken: Taken, shard: SampleShard, step: int, controller: TrainerControl,
               received: Arrivals) -> SampleShard | None:
    """The intake's decision carried out: counted, the controller asked (groups to lease again, prompts in place of
    filtered groups), the arrival recorded; returns what the step trains of the shard (None: nothing)."""
    if taken.refused:
      self.counters.refused_samples += shard.num_samples
      self.refusals.append(taken.refused)
    self.counters.duplicate_samples += taken.duplicates
    if taken.regenerate:
      controller.regenerate(Regenerate(step, taken.regenerate))
      self.counters.groups_regenerated += len(taken.regenerate)
    if taken.arrived is not None:
      received.add(taken.arrived)
    if taken.filtered:
      granted = controller.backfill(Backfill(step, taken.filtered)).count
      received.filtered += len(taken.filtered)
      received.backfilled += granted
      self.intake = backfilled(self.intake, self.rules, granted)
    return taken.train

  def _count_step(self, shards: list, received: Arrivals) -> None:
    self.counters.unique_samples_trained += sum(s.num_samples for s in shards)
    self.counters.samples_planned += self.shape.samples_per_step + (received.backfilled
                                                                       - received.filtered) * self.shape.group_size
    self.counters.groups_filtered += received.filtered
    self.counters.groups_backfilled += received.backfilled

  def _accumulate(self, shard: SampleShard, step: int, clock) -> None:
    begin = clock()
    with self.phase_clock.phase("forward_backward"):
      stale = step - shard.first_versions
      self._step_counts.stale_samples += int(np.sum(stale > self.spec.max_lag))
      fields = self.flow.run(shard_fields(shard, owned=jax.process_count() > 1))  # the stages: its advantages
      self._step_counts.add_stages(self.flow.sums(fields))
      batch = shard.train_batch(fields["advantages"], owned=jax.process_count() > 1, step=step)
      self.state = self.updates.add(self.state, batch, shard.group_ids)
      jax.block_until_ready(self.state.sums)  # the timeline shows compute, not dispatch
    self._step_counts.samples_trained += shard.num_samples
    self.timeline["trainer"].append((begin, clock(), f"step {step}"))


def _restored(state, checkpointer, learners: Mapping) -> tuple:
  """(the state of `checkpointer`'s latest checkpoint, the step it goes on with); each of the flow's `learners` (a
  critic) restored to its state there."""
  if checkpointer is None or checkpointer.latest_step() is None:
    raise FileNotFoundError("resume asked for, but there is no checkpoint to resume from")
  state, extra = checkpointer.restore(state)
  for name, learner in learners.items():
    learner.state = checkpointer.restore(learner.state, item=name)[0]
  return state, int(extra["next_step"])


@dataclasses.dataclass(slots=True)
class StepCounts:
  """What the step being trained counted so far (the run's `TrainerCounters` of the same names take them once the
  step is taken whole: a step cut short by a stop leaves no count behind)."""

  samples_trained: int = 0
  stale_samples: int = 0
  stage_sums: dict = dataclasses.field(default_factory=dict)  # field -> (sum, count) of what the flow's stages wrote

  def add_stages(self, sums: dict) -> None:
    for field, (total, count) in sums.items():
      before = self.stage_sums.get(field, (0.0, 0.0))
      self.stage_sums[field] = (before[0] + total, before[1] + count)

  def stage_means(self) -> dict[str, float]:
    """The step's row keys `stage/<field>`."""
    return {f"stage/{field}": total / count for field, (total, count) in self.stage_sums.items() if count}


@dataclasses.dataclass(slots=True, eq=False)
class TrainerCounters(Counters):
  """What the trainer took and trained. samples_trained counts what went into gradients, unique_samples_trained the
  distinct (step, group, sample) keys among them, samples_planned what the steps' plans asked for: equal when nothing
  was lost or trained twice."""

  samples_trained: int = 0
  unique_samples_trained: int = 0
  samples_planned: int = 0
  stale_samples: int = 0
  trainer_wait_s: float = 0.0
  duplicate_samples: int = 0
  refused_samples: int = 0
  groups_filtered: int = 0
  groups_backfilled: int = 0
  groups_regenerated: int = 0
  empty_steps: int = 0
  weight_version_bytes: int = 0


def _drop_empty_step(batcher: MicroBatcher, shards: list, step: int) -> bool:
  """Whether the step's samples hold no token to train (every completion empty, every episode failed); if so what
  the batcher holds of it is dropped (its rows added nothing: the state's sums are still zero) and a warning says so."""
  if not batcher.rows_seen or sum(s.trained_tokens for s in shards):
    return False
  batcher.discard()
  _warn(f"step {row_step(step)}: its {sum(s.num_samples for s in shards)} samples hold no token to train (every "
        "completion empty or every episode failed); the step is skipped, the weights unchanged")
  return True


def _warn(text: str) -> None:
  """A warning line on stderr, above a progress bar if one is drawn; once for a trainer of several processes."""
  if jax.process_index() == 0:
    tqdm.write(f"warning: {text}", file=sys.stderr)
