"""What the trainer worker asks of the controller, one typed message a call (`streamrl_jax.messages`): the
`TrainerControl` protocol. The controller answers it on the trainer's process 0; `FollowerControl` answers it
on the trainer's other processes, which train the same shards (broadcast by process 0) and keep nothing."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from streamrl_jax.messages import (Ack, Backfill, Backfilled, Published, Regenerate, SamplerWait, SamplerWaitQuery,
                                   StepSummary, StepSummaryRequest, StepTrained)
from streamrl_jax.pipeline.step_plan import backfill_count
from streamrl_jax.run_shape import RunShape


@runtime_checkable
class TrainerControl(Protocol):
  def published(self, message: Published) -> Ack:
    """Weights of a version are out: steps up to version + max_lag may open."""

  def step_trained(self, message: StepTrained) -> StepSummary:
    """A step is trained: the instance target is set from its times; its summary is taken."""

  def take_step_summary(self, message: StepSummaryRequest) -> StepSummary:
    """A step's summary once all its leases reported; the step's plan is removed."""

  def regenerate(self, message: Regenerate) -> Ack:
    """Groups refused as too stale are leased again."""

  def backfill(self, message: Backfill) -> Backfilled:
    """Groups filtered by dynamic sampling: how many more prompts of the step are leased."""

  def sampler_wait(self, message: SamplerWaitQuery) -> SamplerWait:
    """How long the samplers waited for leases and weights."""


NO_SAMPLERS = StepSummary(generation_s=0.0, sampler_instances=1, sampler_processes=1, sampler_rss_mb=0.0, ranker={})


class FollowerControl:
  """`TrainerControl` on a trainer process other than 0: backfill counts by the controller's own rule (the
  shards, hence the filtered groups, are the same); every other answer is neutral."""

  def __init__(self, shape: RunShape):
    self.shape = shape
    self._backfilled: dict[int, int] = {}  # step -> prompts added

  def published(self, message: Published) -> Ack:
    return Ack()

  def step_trained(self, message: StepTrained) -> StepSummary:
    return NO_SAMPLERS

  def take_step_summary(self, message: StepSummaryRequest) -> StepSummary:
    return NO_SAMPLERS

  def regenerate(self, message: Regenerate) -> Ack:
    return Ack()

  def backfill(self, message: Backfill) -> Backfilled:
    used = self._backfilled.get(message.step, 0)
    count = backfill_count(self.shape, used, len(message.filtered))
    self._backfilled[message.step] = used + count
    return Backfilled(count)

  def sampler_wait(self, message: SamplerWaitQuery) -> SamplerWait:
    return SamplerWait(0.0)
