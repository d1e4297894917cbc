"""What the trainer does with each arriving shard, as pure functions of plain data: `take(state, rules, shard) ->
(state, Taken)`.

A shard the step's plan does not hold (or one mixing steps, holding a key twice, or scored by another number of
reward functions) is refused; one of a later step is held for it (`begin` hands it back then); samples taken
already are duplicates (delivered twice, or late); groups holding a token older than the staleness bound are
handed back to be leased again; with dynamic sampling, groups whose rewards are all equal are not trained, and the
prompts the controller grants in their place (`backfilled`) widen the step. The trainer worker applies each
decision (its counters, the controller's messages, the update) and nothing else decides what it trains.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.messages import row_step
from streamrl_jax.pipeline.step_plan import step_group_ids
from streamrl_jax.run_shape import RunShape
from streamrl_jax.streaming import SampleShard


@dataclasses.dataclass(frozen=True)
class IntakeRules:
  """What the intake needs of the run: its length, its steps' plans, the staleness bound and the filter."""

  steps: int
  prompts_per_step: int
  backfill_per_step: int  # group ids a step keeps for dynamic sampling's backfill (0 without it)
  group_size: int
  max_lag: int  # a trained token is at most this many versions older than the step
  dynamic_sampling: bool
  reward_names: tuple[str, ...]

  @property
  def samples_per_step(self) -> int:
    return self.prompts_per_step * self.group_size

  @classmethod
  def of(cls, shape: RunShape) -> IntakeRules:
    """The rules of a run of `shape`; dynamic sampling is on exactly when it may backfill (`backfill_per_step` >= 1:
    `ControllerConfig.backfill_limit` or `prompts_per_step`)."""
    return cls(shape.steps, shape.prompts_per_step, shape.backfill_per_step, shape.group_size, shape.spec.max_lag,
               shape.backfill_per_step > 0, shape.reward_names)


@dataclasses.dataclass(frozen=True)
class IntakeState:
  """The step being taken, the samples it still needs, the keys it took, and shards held for later steps."""

  step: int = -1
  needed: int = 0
  taken: frozenset = frozenset()
  early: tuple[tuple[int, SampleShard], ...] = ()  # (step, shard) in arrival order


@dataclasses.dataclass(frozen=True)
class Taken:
  """One shard's decision: what the step trains of it (None: nothing), what arrived new for the step (its rewards
  count in the step's row, trained or not), why it was refused, the samples taken already, whether it was held for
  a later step, the stale groups to lease again and the equal-reward groups dynamic sampling filtered."""

  train: SampleShard | None = None
  arrived: SampleShard | None = None
  refused: str = ""
  duplicates: int = 0
  held: bool = False
  regenerate: tuple[int, ...] = ()
  filtered: tuple[int, ...] = ()


def begin(state: IntakeState, rules: IntakeRules, step: int) -> tuple[IntakeState, list[SampleShard]]:
  """The intake of `step` (all its samples needed, none taken) and the shards held for it, to take first."""
  held = [shard for s, shard in state.early if s == step]
  early = tuple((s, shard) for s, shard in state.early if s != step)
  return IntakeState(step, rules.samples_per_step, frozenset(), early), held


def take(state: IntakeState, rules: IntakeRules, shard: SampleShard) -> tuple[IntakeState, Taken]:
  """What the step being taken does with `shard`, and the intake after it."""
  problem = refusal(shard, rules)
  if problem:
    return state, Taken(refused=problem)
  shard_step = int(shard.steps[0])
  if shard_step > state.step:
    return dataclasses.replace(state, early=state.early + ((shard_step, shard),)), Taken(held=True)
  new = np.asarray([shard_step == state.step and key not in state.taken for key in shard.keys()], bool)
  duplicates = int((~new).sum())
  if not new.any():
    return state, Taken(duplicates=duplicates)
  shard = shard.take(np.flatnonzero(new)) if duplicates else shard
  stale = too_stale(shard, state.step, rules.max_lag)
  if stale:
    shard = shard.take(np.flatnonzero(~np.isin(shard.group_ids, stale)))
  if not shard.num_samples:
    return state, Taken(duplicates=duplicates, regenerate=stale)
  state = dataclasses.replace(state, needed=state.needed - shard.num_samples, taken=state.taken | set(shard.keys()))
  filtered = tuple(equal_reward_groups(shard)) if rules.dynamic_sampling else ()
  train = shard.take(np.flatnonzero(~np.isin(shard.group_ids, filtered))) if filtered else shard
  return state, Taken(train=train if train.num_samples else None, arrived=shard, duplicates=duplicates,
                      regenerate=stale, filtered=filtered)


def backfilled(state: IntakeState, rules: IntakeRules, granted: int) -> IntakeState:
  """The intake after the controller granted `granted` prompts in place of filtered groups: their samples too."""
  return dataclasses.replace(state, needed=state.needed + granted * rules.group_size)


def too_stale(shard: SampleShard, step: int, max_lag: int) -> tuple[int, ...]:
  """Groups of `shard` holding a token sampled by weights older than step - max_lag."""
  return tuple(sorted({int(g) for g in shard.group_ids[shard.first_versions < step - max_lag]}))


def equal_reward_groups(shard: SampleShard) -> list[int]:
  """Groups of `shard` whose rewards are all equal: no advantage, nothing to learn (DAPO's dynamic sampling)."""
  return sorted(int(g) for g in np.unique(shard.group_ids) if np.ptp(shard.rewards[shard.group_ids == g]) == 0)


def refusal(shard: SampleShard, rules: IntakeRules) -> str | None:
  """Why a shard cannot be trained (None: it can): it mixes steps, is of a step beyond the run, holds a key twice,
  holds another number of reward values a sample, or a sample its step's plan does not (groups `step_group_ids`,
  indices below group_size). With unique keys and a full count, a step trains each of its samples exactly once."""
  if (shard.steps != shard.steps[0]).any():
    return f"a shard mixes samples of steps {[row_step(s) for s in sorted(set(shard.steps.tolist()))[:4]]}"
  shard_step = int(shard.steps[0])
  shown = row_step(shard_step)
  if shard_step >= rules.steps:
    return f"a shard of step {shown}; the run has {rules.steps} steps"
  if len(set(shard.keys())) != shard.num_samples:
    return f"a shard of step {shown} holds a sample twice"
  functions = len(rules.reward_names)
  if shard.reward_parts.shape[1] != functions:
    return (f"a shard of step {shown} holds {shard.reward_parts.shape[1]} reward values a sample; this run's "
            f"RewardConfig has {functions} ({', '.join(rules.reward_names)})")
  planned, extra = step_group_ids(rules, shard_step)
  ours = np.isin(shard.group_ids, np.asarray(planned)) | np.isin(shard.group_ids, np.asarray(extra))
  bad = ~ours | (shard.sample_indices < 0) | (shard.sample_indices >= rules.group_size)
  if bad.any():
    i = int(np.argmax(bad))
    backfill = f", backfill groups {extra.start}..{extra.stop - 1}" if len(extra) else ""
    return (f"step {shown} received sample (group {shard.group_ids[i]}, index {shard.sample_indices[i]}), which "
            f"its plan does not hold (groups {planned.start}..{planned.stop - 1}{backfill}, indices "
            f"0..{rules.group_size - 1})")
  return None
