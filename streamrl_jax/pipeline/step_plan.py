"""The plan of one step as pure functions of plain data: its prompts (from (seed, step) alone, so a resumed run
continues the data stream exactly), the version gate, the cut of its prompts into one lease per live sampler,
and the leases. The controller's parts keep the plans, the roster and the leases; they decide nothing here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from streamrl_jax.messages import Lease, StepReport, StepSummary
from streamrl_jax.run_shape import RunShape
from streamrl_jax.scheduling import SchedulingConfig, dispatch_requests
from streamrl_jax.tasks.rows import draw
from streamrl_jax.types import Rollout


@dataclasses.dataclass
class StepPlan:
  """A step's prompts, their ranker scores, the leases not yet taken, and what came back."""

  prompts: list[str]
  rows: list[str]  # each prompt's row (JSON), for the rewards
  encoded: list[list[int]]
  scores: np.ndarray | None
  unleased: list[Lease]
  leases: int  # how many leases the step was cut into
  reports: dict[int, StepReport] = dataclasses.field(default_factory=dict)  # lease id -> report
  reported_groups: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # lease id -> its groups
  backfilled: int = 0  # prompts added by dynamic sampling
  observed: bool = False  # the ranker has learnt from this step's lengths
  delivered: dict = dataclasses.field(default_factory=dict)  # group id -> mean completion length
  summary: StepSummary | None = None


def step_prompts(shape: RunShape, task, step: int) -> list[tuple[str, str]]:
  """The prompts of `step`, each with its row as JSON: `prompts_per_step` draws of the task from a generator seeded
  by (seed, step)."""
  rng = np.random.default_rng([shape.seed, step])
  return [_drawn(task, rng) for _ in range(shape.prompts_per_step)]


def backfill_prompts(shape: RunShape, task, step: int, start: int, count: int) -> list[tuple[str, str]]:
  """Backfill prompts start..start+count-1 of `step` (dynamic sampling), with their rows: draws of a generator
  seeded by (seed, step, 1), so a resumed step adds the same prompts in the same order."""
  rng = np.random.default_rng([shape.seed, step, 1])
  return [_drawn(task, rng) for _ in range(start + count)][start:]


def _drawn(task, rng) -> tuple[str, str]:
  prompt, row = draw(task, rng)
  return prompt, row.to_json()


def backfill_count(shape: RunShape, used: int, filtered: int) -> int:
  """How many prompts dynamic sampling adds for `filtered` untrained groups when `used` were added already."""
  return max(0, min(filtered, shape.backfill_per_step - used))


def step_group_ids(shape: RunShape, step: int) -> tuple[range, range]:
  """The group ids of `step`: its planned prompts', then those dynamic sampling may add. Each step has
prompts_per_step + backfill_per_step consecutive ids (without dynamic sampling the planned ones alone), fixed by
the step whatever the run's length, so a resumed run that runs longer keys its samples the same."""
  first = step * (shape.prompts_per_step + shape.backfill_per_step)
  extra = first + shape.prompts_per_step
  return range(first, extra), range(extra, extra + shape.backfill_per_step)


def group_owner(group_id: int, processes: int) -> int:
  """The trainer process whose data shard trains group `group_id` (groups dealt round the processes, so a step's
  groups split evenly): samplers send the group there, and only that process's door takes it."""
  return int(group_id) % max(processes, 1)


def min_version(start_step: int, step: int, max_lag: int) -> int:
  """The version gate: the oldest weights a step's generation may start with."""
  return max(start_step, step - max_lag)


def cut_prompts(shape: RunShape, scheduling: SchedulingConfig, num_slots: int, step: int, predicted: Sequence[float],
                history, parts: int) -> list[np.ndarray]:
  """A step's prompt indices cut into one lease per live sampler (`parts`): consecutive equal slices, or with
  a policy that needs the ranker and its predictions, the dispatch policy's groups (the predicted-longest
  prompts together on as many samplers as the latency model gives them, each of `num_slots` slots: the
  engine's), prompts standing for their groups."""
  parts = max(1, min(parts, shape.prompts_per_step))
  if not predicted or parts == 1 or not scheduling.scheduling_policy.needs_ranker:
    return np.array_split(np.arange(shape.prompts_per_step), parts)
  slots_in_prompts = max(1, num_slots // shape.group_size)
  dispatch = dispatch_requests(scheduling, predicted, history, list(range(parts)), slots_in_prompts,
                               seed=shape.seed * 100_003 + step)
  return [np.asarray(sorted(a)) for a in dispatch.plan.assignment if len(a)]


def step_leases(shape: RunShape, step: int, plan: StepPlan, cuts: Sequence[np.ndarray], predicted: Sequence[float],
                quantiles: Sequence[float], gate: int, instances: int) -> list[Lease]:
  """One lease per cut of the plan's prompts (lease ids are given when a sampler takes one); group ids number
  the run's prompts."""
  first = step_group_ids(shape, step)[0].start
  return [Lease(lease_id=-1, step=step, group_ids=tuple(first + int(i) for i in idx),
                prompts=tuple(plan.prompts[i] for i in idx), predicted_lengths=tuple(predicted[i] for i in idx)
                if predicted else (), length_quantiles=tuple(quantiles), min_version=gate, instances=instances,
                rows=tuple(plan.rows[i] for i in idx), prompt_tokens=tuple(tuple(plan.encoded[i]) for i in idx))
          for idx in cuts]


def partial_problem(shape: RunShape, held: set, partials: Sequence[Rollout]) -> str | None:
  """What is wrong with the first of `partials` a leaving sampler hands back, given the groups of the leases it
  holds (None: nothing): a group it does not hold, an index outside the group, a sample twice, no tokens, or more
  tokens than a sample may have."""
  seen = set()
  for p in partials:
    key = (p.group_id, p.sample_index)
    longest = shape.max_new_tokens if p.finished else shape.max_new_tokens - 1
    problem = ("is not of a lease it holds" if p.group_id not in held else
               "is not in the group" if p.sample_index >= shape.group_size else
               "is there twice" if key in seen else "has no tokens" if not p.completion_tokens else
               f"has {len(p.completion_tokens)} tokens, more than max_new_tokens={shape.max_new_tokens} allows"
               if len(p.completion_tokens) > longest else None)
    if problem:
      return f"sample {p.sample_index} of group {p.group_id}, which {problem}"
    seen.add(key)
  return None
