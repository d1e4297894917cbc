"""A trainer step's metrics row: the rewards of what arrived, what was trained (staleness, filtered and
environment tokens), and where the step's seconds went."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from streamrl_jax.messages import StepSummary, row_step
from streamrl_jax.pipeline.trainer.step_intake import equal_reward_groups
from streamrl_jax.phase_clock import accounted_frac
from streamrl_jax.records.metric_table import SAMPLERS, STEP, UPDATE
from streamrl_jax.run_shape import RunShape
from streamrl_jax.streaming import SampleShard
from streamrl_jax.tasks.heldout import accuracy


@dataclasses.dataclass(frozen=True)
class StepTimes:
  """A step's seconds: waiting for samples (`waited`), from the last step's end to this one's (`wall`), its
  accumulation and update (`train_s`); the samplers' idle share of the run so far (`sampler_idle`); the publisher's
  seconds of each version sent (`weight_seconds`, by version)."""

  waited: float
  wall: float
  train_s: float
  sampler_idle: float
  weight_seconds: dict


@dataclasses.dataclass
class Arrivals:
  """What arrived for a step, trained or not (the row's reward figures), and the groups dynamic sampling filtered
  and the prompts backfilled in their place. One thread's, filled as the step's shards arrive."""

  rewards: list = dataclasses.field(default_factory=list)  # a float32 [n] per shard
  parts: list = dataclasses.field(default_factory=list)  # a float32 [n, functions] per shard
  errors: int = 0  # reward calls that raised or returned no number
  timeouts: int = 0  # reward calls past their limit
  filtered: int = 0  # equal-reward groups not trained
  backfilled: int = 0  # prompts granted in their place

  def add(self, shard: SampleShard) -> None:
    """Every arrived group's rewards and reward calls, trained or not (the step's reward metrics)."""
    self.rewards.append(shard.rewards)
    self.parts.append(shard.reward_parts)
    self.errors += int(shard.reward_errors.sum())
    self.timeouts += int(shard.reward_timeouts.sum())


def step_parts(shape: RunShape, step: int, shards: list, received: Arrivals, update: dict, own: dict,
               times: StepTimes, summary: StepSummary) -> dict[str, dict]:
  """Step `step`'s metrics row as its parts (`metric_table.join_row`), in a run of `shape`: the step's own figures
  from `shards` trained, `received` (every group that arrived, trained or filtered: see `Arrivals`), its `times` and
  `own` (the batcher's and the worker's: calls, tokens, skipped update); the update's metrics `update`; the samplers'
  `summary`."""
  rewards = np.concatenate(received.rewards)  # every group that arrived, trained or filtered
  counts = [s.staleness_sum_max(step) for s in shards]
  tokens, stale_sum = sum(c[0] for c in counts), sum(c[1] for c in counts)
  stale_max = max((c[2] for c in counts if c[0]), default=0)  # (a step with no token to train: 0)
  seconds = [v for _, v in sorted(times.weight_seconds.items())]
  flat = sum(len(equal_reward_groups(s)) for s in shards)
  parts = np.concatenate(received.parts).mean(axis=0)
  by_function = {f"reward/{name}": float(v) for name, v in zip(shape.reward_names, parts)}
  wall = times.wall
  mine = dict(step=row_step(step), time=time.time(), reward_mean=float(rewards.mean()), **by_function,
              reward_errors=received.errors, reward_timeouts=received.timeouts,
              accuracy=accuracy(rewards), samples_per_s=len(rewards) / max(wall, 1e-9),
              staleness_mean=stale_sum / max(tokens, 1), staleness_max=stale_max,  # per trained token
              groups_filtered=received.filtered, groups_backfilled=received.backfilled,
              prompts_leased=shape.prompts_per_step + received.backfilled, equal_reward_groups_trained=flat,
              env_tokens=sum(s.env_tokens for s in shards),
              trainer_idle_frac=min(1.0, times.waited / max(wall, 1e-9)),
              sampler_idle_frac=min(1.0, times.sampler_idle), weight_sync_s=float(seconds[-1]) if seconds else 0.0,
              step_s=wall, train_s=times.train_s, **own)
  return {STEP: mine, UPDATE: update, SAMPLERS: summary.metrics()}


def batch_metrics(before: dict, after: dict) -> dict:
  """A step's calls, real tokens and padding share, from the micro-batcher's counters `before` and `after` it."""
  done = {k: v - before[k] for k, v in after.items()}
  return dict(train_calls=done["calls"], train_tokens=done["real_tokens"],
              train_padding_frac=1.0 - done["real_tokens"] / max(done["computed_tokens"], 1))


def phase_row(seconds: dict[str, float]) -> dict:
  """A row's `trainer_s/<phase>` seconds (the training thread's since the previous row: this step's checkpoint is in
  the next row; their sum is the gap between the rows) and `trainer_accounted_frac` (the share in a named phase)."""
  return {**{f"trainer_s/{name}": s for name, s in seconds.items()}, "trainer_accounted_frac": accounted_frac(seconds)}
