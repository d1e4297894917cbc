"""The steps' plans (made by the pure functions of `pipeline.step_plan`): the version gate, which step opens
next, its prompts cut into leases, leases handed back, backfill and regeneration, the groups delivered and the
samplers' reports, and each step's `StepSummary` (where the ranker learns the realised lengths).

A step opens once version >= step - max_lag is published; its prompts depend on (seed, step) alone, so a
resumed run continues the data stream exactly. A lease added to a step (backfill, regeneration, a lease
handed back) is taken before any later step's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from streamrl_jax.messages import Lease, StepReport, StepSummary
from streamrl_jax.pipeline.controller.timeline import Timeline
from streamrl_jax.pipeline.step_plan import (StepPlan, backfill_count, backfill_prompts, cut_prompts, min_version,
                                             step_group_ids, step_leases, step_prompts)
from streamrl_jax.run_shape import RunShape
from streamrl_jax.scheduling import SchedulingConfig, lengths_from_scores, ranking_metrics
from streamrl_jax.tasks.rows import prompt_tokens
from streamrl_jax.types import Rollout


class StepPlans:
  """Plans by step from `start_step`, for `shape.steps`; the ranker (or None) scores each step's prompts, and a
  step's prompts are cut into leases by `scheduling`'s dispatch policy over engines of `num_slots` slots."""

  def __init__(self, shape: RunShape, scheduling: SchedulingConfig, num_slots: int, task, tokenizer,
               timeline: Timeline, *, start_step: int, ranker=None):
    self.shape, self.scheduling, self.num_slots = shape, scheduling, num_slots
    self.task, self.tokenizer, self.ranker = task, tokenizer, ranker
    self.start_step, self._timeline = start_step, timeline
    self._version = -1  # nothing published yet
    self._next_step = start_step
    self._plans: dict[int, StepPlan] = {}

  @property
  def version(self) -> int:
    """The newest version published (-1: none); steps below it are trained."""
    return self._version

  @property
  def next_step(self) -> int:
    """The step planned next."""
    return self._next_step

  def publish(self, version: int) -> None:
    self._version = max(self._version, version)

  def next_lease(self, parts: int, instances: int) -> Lease | None:
    """The next lease of an open step, planning the next step (cut into `parts` leases) when the gate opens it."""
    for step in sorted(self._plans):
      if self._plans[step].unleased:
        return self._plans[step].unleased.pop(0)
    step = self._next_step
    if step >= self.shape.steps or self._version < self._min_version(step):
      return None
    self._plans[step] = self._plan(step, parts, instances)
    self._next_step += 1
    return self._plans[step].unleased.pop(0)

  def report(self, lease: Lease, message: StepReport) -> None:
    """The report of `lease`; the step is summarised once all its leases reported."""
    plan = self._plans[lease.step]
    plan.reports[lease.lease_id] = message
    plan.reported_groups[lease.lease_id] = lease.group_ids
    self._summarise_if_done(lease.step)

  def delivered(self, step: int, lengths: dict[int, float]) -> None:
    """Groups of `step` arrived, with their mean completion lengths."""
    if step in self._plans:
      self._plans[step].delivered.update(lengths)

  def hand_back(self, lease: Lease, partials: Sequence[Rollout] = ()) -> tuple[int, ...]:
    """An unreported lease of a sampler that left or was lost: its groups not yet delivered go back to the front
    of the step with the `partials` begun of them; returns those groups (none: only the report is lost)."""
    plan = self._plans[lease.step]
    missing = [i for i, g in enumerate(lease.group_ids) if g not in plan.delivered]
    self._timeline.count(groups_kept=len(lease.group_ids) - len(missing))
    if not missing:
      plan.leases -= 1
      self._summarise_if_done(lease.step)
      return ()
    groups = tuple(lease.group_ids[i] for i in missing)
    pick = lambda values: tuple(values[i] for i in missing) if values else ()  # noqa: E731
    begun = tuple(p for p in partials if p.group_id in set(groups))
    plan.unleased.insert(0, dataclasses.replace(lease, group_ids=groups, prompts=pick(lease.prompts),
                                                predicted_lengths=pick(lease.predicted_lengths), partials=begun,
                                                rows=pick(lease.rows), prompt_tokens=pick(lease.prompt_tokens)))
    self._timeline.count(partial_samples_handed_back=len(begun))
    return groups

  def backfill(self, step: int, filtered: Sequence[int], instances: int) -> int:
    """Dynamic sampling: as many more prompts of `step` as its backfill bound still allows for the `filtered`
    groups, in one more lease; returns how many (an event records the filtered groups)."""
    plan = self._plans.get(step)
    count = 0 if plan is None else backfill_count(self.shape, plan.backfilled, len(filtered))
    self._timeline.event("groups_filtered", step=step, group_ids=list(filtered), backfilled=count)
    if count <= 0:
      return 0
    drawn = backfill_prompts(self.shape, self.task, step, plan.backfilled, count)
    ids = step_group_ids(self.shape, step)[1][plan.backfilled:plan.backfilled + count]
    self._hand_out(step, ids, drawn, instances)
    plan.backfilled += count
    self._timeline.count(prompts_backfilled=count)
    return count

  def regenerate(self, step: int, group_ids: Sequence[int], instances: int) -> None:
    """The groups `group_ids` of `step` are leased again, to be generated afresh."""
    plan = self._plans.get(step)
    if plan is None:
      return
    planned, extra = step_group_ids(self.shape, step)
    drawn = [(plan.prompts[g - planned.start], plan.rows[g - planned.start]) if g in planned else
             backfill_prompts(self.shape, self.task, step, g - extra.start, 1)[0] for g in group_ids]
    for g in group_ids:
      plan.delivered.pop(g, None)
    self._hand_out(step, group_ids, drawn, instances)
    self._timeline.count(groups_regenerated=len(group_ids))
    self._timeline.event("groups_regenerated", step=step, group_ids=list(group_ids))

  def summarised(self, step: int) -> bool:
    """Whether every lease of `step` reported (its summary is ready)."""
    return step in self._plans and self._plans[step].summary is not None

  def take(self, step: int) -> tuple[StepSummary, list[int]]:
    """The summary of a summarised step and its reported lease ids; the plan is removed."""
    plan = self._plans.pop(step)
    return plan.summary, list(plan.reports)

  def _hand_out(self, step: int, group_ids, drawn, instances: int) -> None:
    """One more lease of `step` for `drawn` (prompt, row) pairs; the step is summarised again once it reports."""
    plan = self._plans[step]
    plan.unleased.append(Lease(lease_id=-1, step=step, group_ids=tuple(int(g) for g in group_ids),
                               prompts=tuple(p for p, _ in drawn), predicted_lengths=(), length_quantiles=(),
                               min_version=self._min_version(step), instances=instances,
                               rows=tuple(r for _, r in drawn),
                               prompt_tokens=tuple(tuple(prompt_tokens(self.task, self.tokenizer, p)) for p, _ in drawn)))
    plan.leases += 1
    plan.summary = None

  def _min_version(self, step: int) -> int:
    return min_version(self.start_step, step, self.shape.spec.max_lag)

  def _plan(self, step: int, parts: int, instances: int) -> StepPlan:
    shape = self.shape
    drawn = step_prompts(shape, self.task, step)
    prompts, rows = [p for p, _ in drawn], [r for _, r in drawn]
    encoded = [prompt_tokens(self.task, self.tokenizer, p) for p in prompts]
    scores, predicted, quantiles, history = None, (), (), ()
    if self.ranker is not None:
      history = self.ranker.history_lengths
      scores = self.ranker.scores(encoded)
      predicted = tuple(float(x) for x in lengths_from_scores(scores, history, default=shape.max_new_tokens / 2))
      if history.size:
        quantiles = tuple(float(x) for x in np.percentile(history, np.arange(101)))
    cuts = cut_prompts(shape, self.scheduling, self.num_slots, step, predicted, history, parts=parts)
    plan = StepPlan(prompts, rows, encoded, scores, [], 0)
    plan.unleased = step_leases(shape, step, plan, cuts, predicted, quantiles, self._min_version(step), instances)
    plan.leases = len(plan.unleased)
    return plan

  def _summarise_if_done(self, step: int) -> None:
    plan = self._plans[step]
    if len(plan.reports) == plan.leases:
      plan.summary = summarise(self.shape, self.ranker, step, plan)


def summarise(shape: RunShape, ranker, step: int, plan: StepPlan) -> StepSummary:
  """The step's summary from its reports; the ranker (once a step) learns the realised lengths of the planned
  groups and its figures are added."""
  reports = list(plan.reports.values())
  by_group = dict(plan.delivered)  # groups of a lease handed back: their length as delivered
  by_group.update({g: length for lease_id, r in plan.reports.items()
                   for g, length in zip(plan.reported_groups[lease_id], r.lengths)})
  planned = step_group_ids(shape, step)[0]  # the ranker scored these; backfilled ones are apart
  lengths = np.asarray([by_group[k] for k in sorted(by_group) if k in planned])
  figures = {}
  if ranker is not None:
    if len(lengths) >= 2:
      figures.update({f"ranker_{k}": v for k, v in ranking_metrics(plan.scores, lengths).items()})
    if not plan.observed:  # once a step, also when a late lease (a backfill) summarises it again
      ranker.observe(plan.encoded, lengths)
      plan.observed = True
    figures["ranker_train_steps"] = ranker.counters.train_steps
  told = [r.phase_s for r in reports if r.phase_s]  # each sampler's seconds by phase: added up
  return StepSummary(generation_s=max((r.generation_s for r in reports), default=0.0),
                     sampler_instances=sum({r.sampler_id: r.instances for r in reports}.values()),
                     sampler_processes=len({r.sampler_id for r in reports}),
                     sampler_rss_mb=max((r.rss_mb for r in reports), default=0.0), ranker=figures,
                     phase_s=tuple(float(x) for x in np.sum(told, axis=0)) if told else (),
                     template_prefix_mismatch=sum(r.template_prefix_mismatch for r in reports))
