"""The controller: one lock, and each message routed to the parts that own the state (`roster`, `leases`,
`plans`, `weight_trees`, `timeline`). Samplers and the trainer reach it only through the typed messages of
`streamrl_jax.messages` (directly in one process, samplers' over Arrow Flight DoAction across processes); it
answers the trainer's as a `pipeline.trainer.control.TrainerControl`.

Faults: a sampler that leaves, or is silent for `ControllerConfig.lease_timeout_s` (checked by `start_watchdog`), loses its
leases, which go back to the front of their steps for the others. A lost sampler's samples that arrive late
are still taken (the trainer keeps the first copy of each (step, group, sample)), and it is told to register
again; so is a sampler the controller never knew (one of a trainer that restarted).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from streamrl_jax.messages import (Ack, Backfill, Backfilled, BadMessage, Delivery, Heartbeat, HeartbeatReply,
                                   LeaseReply, LeaseRequest, Leave, Published, Regenerate, Register, Registered,
                                   SamplerWait, SamplerWaitQuery, StepReport, StepSummary, StepSummaryRequest,
                                   StepTrained, row_step)
from streamrl_jax.pipeline.controller.config import ControllerConfig
from streamrl_jax.pipeline.controller.door import Door
from streamrl_jax.pipeline.controller.leases import Leases
from streamrl_jax.pipeline.controller.plans import StepPlans
from streamrl_jax.pipeline.controller.roster import Roster, check_registration
from streamrl_jax.pipeline.controller.timeline import Timeline
from streamrl_jax.pipeline.controller.weight_trees import WeightTrees
from streamrl_jax.pipeline.step_plan import partial_problem
from streamrl_jax.pipeline.watchdog import Watchdog
from streamrl_jax.run_shape import RunShape
from streamrl_jax.scheduling import SchedulingConfig
from streamrl_jax.types import Rollout

MAX_LEASE_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class JoinTerms:
  """What samplers join: the run's `settings`, which each must register with, and the trainer's datacenter label
  `site` (samplers of other sites get one copy of each version across)."""

  settings: dict | None = None
  site: str = ""
  data_endpoints: tuple[str, ...] = ()  # each trainer process's sample door, by process (empty: this server's alone)


@dataclasses.dataclass(frozen=True)
class ControllerSetup:
  """What a controller is built from: the run's shape and the configs of the parts it plans and watches."""

  shape: RunShape  # the run's steps, prompts, groups, seed and lengths
  controller: ControllerConfig  # the heartbeat, the lease timeout, the summary wait, the weight tree's fan-out
  scheduling: SchedulingConfig  # the dispatch policy that cuts a step's prompts, and the instance counts
  num_slots: int  # the sampler engine's slots (`EngineConfig.num_slots`): a lease's prompts fill them by groups


class Controller:
  """Routes the control messages to its parts under one lock; thread-safe."""

  def __init__(self, setup: ControllerSetup, task, tokenizer, *, start_step: int, terms: JoinTerms = JoinTerms(),
               ranker=None, on_event: Callable[[dict], None] | None = None,
               clock: Callable[[], float] = time.monotonic):
    """`setup.controller` (a `ControllerConfig`) holds the heartbeat, the lease timeout, how long a step's
    summary is waited for (`sampler_timeout_s`) and the weight tree's fan-out."""
    self.shape, self.settings, self.start_step = setup.shape, dict(terms.settings or {}), start_step
    self.data_endpoints = tuple(terms.data_endpoints)
    control = setup.controller
    self.heartbeat_s, self.summary_timeout_s = control.heartbeat_s, control.sampler_timeout_s
    self.timeline = Timeline(on_event)
    self.roster = Roster(setup.scheduling, self.timeline, lease_timeout_s=control.lease_timeout_s, clock=clock)
    self.leases = Leases(self.timeline)
    self.plans = StepPlans(setup.shape, setup.scheduling, setup.num_slots, task, tokenizer, self.timeline,
                           start_step=start_step, ranker=ranker)
    self.trees = WeightTrees(self.timeline, site=terms.site, fanout=control.weight_fanout)
    self._cond, self._clock = threading.Condition(), clock  # the clock: when samplers were last heard from
    self.door = Door(setup.shape.group_size, self.roster, self.leases, self.plans, self.timeline, self._cond)
    self._watchdog: Watchdog | None = None
    self.counters, self.events, self.busy = self.timeline.counters, self.timeline.events, self.timeline.busy

  def handlers(self) -> dict:
    """The control messages the trainer's Flight server hands to this controller, by type (its `door` judges the
    sample batches)."""
    return {Register: self.register, LeaseRequest: self.lease, StepReport: self.report, Heartbeat: self.heartbeat,
            Leave: self.leave, Delivery: self.door.deliver}

  # ---- sampler-facing messages ---------------------------------------------------------------
  def register(self, message: Register) -> Registered:
    check_registration(self.settings, message)
    with self._cond:
      sampler_id = self.roster.add(message.name, message.site, message.relay)
      self.timeline.event("sampler_joined", sampler=message.name, sampler_id=sampler_id,
                          next_step=self.plans.next_step, site=message.site, relay=message.relay)
      self._cond.notify_all()
    return Registered(sampler_id=sampler_id, start_step=self.start_step, steps=self.shape.steps,
                      heartbeat_s=self.heartbeat_s, data_endpoints=self.data_endpoints)

  def lease(self, message: LeaseRequest) -> LeaseReply:
    """The next lease of an open step, waiting up to `wait_s` for one to open; finished once the run is over."""
    deadline = time.monotonic() + min(max(message.wait_s, 0.0), MAX_LEASE_WAIT_S)
    with self._cond:
      self.roster.heard(message.sampler_id)  # heard from now; not again while the request waits here
      while True:
        reply = self._lease_now(message.sampler_id)
        if reply is not None:
          return reply
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return LeaseReply(lease=None, finished=False)
        self._cond.wait(remaining)

  def _lease_now(self, sampler_id: int) -> LeaseReply | None:
    """A reply to a lease request (lock held), or None: nothing to lease yet."""
    if self.roster.finished:
      self._cond.notify_all()
      return LeaseReply(lease=None, finished=True)
    if sampler_id not in self.roster:  # lost while the request waited, or never known
      self.timeline.count(rejoin_requests=1)
      return LeaseReply(lease=None, finished=False, rejoin=True)
    lease = self.plans.next_lease(len(self.roster), self.roster.target_instances)
    if lease is None:
      return None
    return LeaseReply(lease=self.leases.grant(sampler_id, lease, self.roster.target_instances), finished=False)

  def report(self, message: StepReport) -> Ack:
    """Records what a sampler measured for a lease; the step's summary is made once all its leases reported.
    A lost sampler's report is ignored (its lease went to another) and it is told to register again."""
    with self._cond:
      if message.sampler_id not in self.roster:
        self.timeline.count(late_reports=1)
        return Ack(rejoin=True)
      self.roster.heard(message.sampler_id)
      lease = self.leases.held(message.sampler_id, message.lease_id, message.step)
      if lease is None:
        raise BadMessage(f"sampler {message.sampler_id} reported lease {message.lease_id} of step "
                         f"{row_step(message.step)}, which it does not hold")
      if len(message.lengths) != len(lease.prompts):
        raise BadMessage(f"report of lease {message.lease_id}: {len(message.lengths)} lengths for "
                         f"{len(lease.prompts)} prompts")
      self.plans.report(lease, message)
      self.leases.reported(message.sampler_id, message.lease_id)
      self.timeline.spans(self.roster.name_of(message.sampler_id), message.busy, f"step {message.step}")
      self.timeline.count(reports=1, prompts_submitted=len(lease.prompts), samples_generated=message.samples,
                          sampler_wait_s=message.wait_s)
      self._cond.notify_all()
    return Ack()

  def heartbeat(self, message: Heartbeat) -> HeartbeatReply:
    with self._cond:
      finished = self.roster.finished
      if message.sampler_id not in self.roster:
        if not finished:
          self.timeline.count(rejoin_requests=1)
        return HeartbeatReply(stop=finished, rejoin=not finished)
      self.roster.heard(message.sampler_id)
      return HeartbeatReply(stop=finished)

  def leave(self, message: Leave) -> Ack:
    """A sampler leaves: its unreported leases go back to their steps with the samples it had begun (partial
    rollouts). Partials outside its open leases, or too long, refuse the whole message (its leases then go back
    without them when it is declared lost)."""
    with self._cond:
      if message.sampler_id in self.roster:
        problem = partial_problem(self.shape, self.leases.open_groups(message.sampler_id), message.partials)
        if problem:
          raise BadMessage(f"sampler {message.sampler_id} hands back {problem}")
        self._drop(message.sampler_id, lost=False, partials=message.partials)
    return Ack()

  def weight_source(self, sampler_id: int, version: int) -> str:
    """Where `sampler_id` fetches `version` from: its parent's relay in the version's broadcast tree, or "" for
    the trainer (not in that tree, or its parent is gone)."""
    with self._cond:
      if version not in self.trees:
        self.trees.plant(version, self.roster.members())
      parent = self.trees.parent(version, sampler_id)
      return self.roster.relay_of(parent) if parent is not None else ""

  # ---- faults --------------------------------------------------------------------------------
  def expire_silent(self) -> list[str]:
    """Declares lost every sampler silent for more than `lease_timeout_s`; returns their names."""
    with self._cond:
      return [self._drop(i, lost=True) for i in self.roster.silent()]

  def start_watchdog(self, period: float | None = None) -> None:
    """Checks for silent samplers every `period` s (default: a quarter of the lease timeout) on a thread of
    its own; a late tick (this process was paused) gives every sampler a fresh start instead."""
    self._watchdog = Watchdog(period or self.roster.lease_timeout_s / 4, self.expire_silent, self._paused, self._clock)
    self._watchdog.start()

  def _paused(self, seconds: float) -> None:
    with self._cond:
      self.roster.all_heard()
      self.timeline.event("trainer_paused", seconds=round(seconds, 2))

  def close(self) -> None:
    """Stops the watchdog."""
    if self._watchdog is not None:
      self._watchdog.close()

  def _drop(self, sampler_id: int, *, lost: bool, partials: tuple[Rollout, ...] = ()) -> str:
    """Removes a sampler (lock held); its unreported leases go back to the front of their steps, with the
    `partials` of their groups not yet delivered."""
    leases = self.leases.take_back(sampler_id, lost=lost)
    name = self.roster.remove(sampler_id, lost=lost)
    loss = (time.time(), name)
    for lease in reversed(leases):
      missing = self.plans.hand_back(lease, partials)
      if lost:
        self.leases.lost(lease.step, missing, loss)
    self.timeline.event("sampler_lost" if lost else "sampler_left", sampler=name, sampler_id=sampler_id,
                        leases_returned=len(leases))
    self._cond.notify_all()
    return name

  # ---- trainer-facing: `TrainerControl` ------------------------------------------------------
  def published(self, message: Published) -> Ack:
    """The trainer has published weights of a version: steps up to version + max_lag may open."""
    with self._cond:
      self.plans.publish(message.version)
      self.leases.trained_below(self.plans.version, self.roster)
      self._cond.notify_all()
    return Ack()

  def backfill(self, message: Backfill) -> Backfilled:
    """Dynamic sampling: leases as many more prompts of the step as its backfill bound still allows, before any
    later step's."""
    with self._cond:
      count = self.plans.backfill(message.step, message.filtered, self.roster.target_instances)
      self._cond.notify_all()
    return Backfilled(count)

  def regenerate(self, message: Regenerate) -> Ack:
    """Groups the trainer refused as too stale are leased again, to be generated afresh."""
    with self._cond:
      self.plans.regenerate(message.step, message.group_ids, self.roster.target_instances)
      self._cond.notify_all()
    return Ack()

  def step_trained(self, message: StepTrained) -> StepSummary:
    """Sets the instance target of the next leases by the elastic rule from the step's times; returns (and
    removes) the step's summary."""
    summary = self.take_step_summary(StepSummaryRequest(message.step))
    with self._cond:
      self.roster.retarget(summary, message.train_s)
    return summary

  def take_step_summary(self, message: StepSummaryRequest) -> StepSummary:
    """The step's summary once all its leases reported; its plan is removed. `TimeoutError` after the timeout."""
    timeout = self.summary_timeout_s if message.timeout_s is None else message.timeout_s
    with self._cond:
      if not self._cond.wait_for(lambda: self.plans.summarised(message.step), timeout):
        raise TimeoutError(f"the samplers' reports of step {row_step(message.step)} did not arrive within {timeout} s")
      summary, reported = self.plans.take(message.step)
      self.leases.forget(reported)  # kept until now: a lease added late (a backfill) summarises the step again
      return summary

  def sampler_wait(self, message: SamplerWaitQuery) -> SamplerWait:
    """Seconds the samplers waited for leases and weights, per sampler on average."""
    with self._cond:
      return SamplerWait(self.timeline.per_sampler("sampler_wait_s"))

  # ---- the run's end and the trainer's watch -------------------------------------------------
  def set_target_instances(self, instances: int) -> None:
    with self._cond:
      self.roster.set_target(instances)

  def silent_s(self) -> float | None:
    """Seconds since any registered sampler was last heard from (None: none registered)."""
    with self._cond:
      return self.roster.silent_s()

  def finish(self) -> None:
    """No more leases: samplers are told the run is over at their next lease request or heartbeat."""
    with self._cond:
      self.roster.finish()
      self._cond.notify_all()

  def wait_samplers_left(self, timeout: float) -> bool:
    """After `finish`: waits until every registered sampler has left."""
    with self._cond:
      return self._cond.wait_for(lambda: not len(self.roster), timeout)
