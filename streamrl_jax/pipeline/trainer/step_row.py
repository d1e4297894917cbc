"""A trainer step's metrics row: the rewards of what arrived, what was trained (staleness, filtered and
environment tokens), and where the step's seconds went."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from streamrl_jax.messages import StepSummary
from streamrl_jax.phase_clock import accounted_frac
from streamrl_jax.streaming import SampleShard


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


def step_row(config, step: int, shards: list, received: dict, train: dict, times: StepTimes,
             summary: StepSummary) -> dict:
  """Step `step`'s metrics row: `shards` trained, `received` (every group that arrived, trained or filtered: see
  `record_arrival`), the update's metrics `train`, its `times` and the samplers' `summary`."""
  rewards = np.concatenate(received["rewards"])  # every group that arrived, trained or filtered
  stale = np.concatenate([s.token_staleness(step) for s in shards] + [np.zeros(0, np.int64)])
  stale = stale if stale.size else np.zeros(1)  # (a step with no token to train)
  seconds = [v for _, v in sorted(times.weight_seconds.items())]
  flat = sum(len(equal_reward_groups(s)) for s in shards)
  parts = np.concatenate(received["parts"]).mean(axis=0)
  by_function = {f"reward/{name}": float(v) for name, v in zip(config.sampler.reward.names, parts)}
  wall = times.wall
  return dict(step=step + 1, time=time.time(), reward_mean=float(rewards.mean()), **by_function,
              reward_errors=received["errors"], reward_timeouts=received["timeouts"],
              accuracy=float(np.mean(rewards >= 1.0)), samples_per_s=len(rewards) / max(wall, 1e-9),
              staleness_mean=float(np.mean(stale)), staleness_max=int(np.max(stale)),  # per trained token
              groups_filtered=received["filtered"], groups_backfilled=received["backfilled"],
              prompts_leased=config.prompts_per_step + received["backfilled"], equal_reward_groups_trained=flat,
              env_tokens=sum(env_tokens(s) for s in shards),
              trainer_idle_frac=min(1.0, times.waited / max(wall, 1e-9)),
              sampler_idle_frac=min(1.0, times.sampler_idle), weight_sync_s=float(seconds[-1]) if seconds else 0.0,
              step_s=wall, train_s=times.train_s, kl_mean=train.get("kl", 0.0), **summary.metrics(), **train)


def batch_metrics(before: dict, after: dict) -> dict:
  """A step's calls, real tokens and padding share, from the micro-batcher's counters `before` and `after` it."""
  done = {k: v - before[k] for k, v in after.items()}
  return dict(train_calls=done["calls"], train_tokens=done["real_tokens"],
              train_padding_frac=1.0 - done["real_tokens"] / max(done["computed_tokens"], 1))


def phase_row(seconds: dict[str, float]) -> dict:
  """A row's `trainer_s/<phase>` seconds (the training thread's since the previous row: this step's checkpoint is in
  the next row), `step_wall_s` (their sum) and `trainer_accounted_frac` (the share in a named phase)."""
  return {**{f"trainer_s/{name}": s for name, s in seconds.items()}, "step_wall_s": sum(seconds.values()),
          "trainer_accounted_frac": accounted_frac(seconds)}


def record_arrival(received: dict, shard: SampleShard) -> None:
  """Every arrived group's rewards and reward calls, trained or not (the step's reward metrics)."""
  received["rewards"].append(shard.rewards)
  received["parts"].append(shard.reward_parts)
  received["errors"] += int(shard.reward_errors.sum())
  received["timeouts"] += int(shard.reward_timeouts.sum())


def equal_reward_groups(shard: SampleShard) -> list[int]:
  """Groups of `shard` whose rewards are all equal: no advantage, nothing to learn (DAPO's dynamic sampling)."""
  return sorted(int(g) for g in np.unique(shard.group_ids)
                if np.ptp(shard.rewards[shard.group_ids == g]) == 0)


def env_tokens(shard: SampleShard) -> int:
  """Tokens an environment wrote into the completions (masked, after a row's first trained token)."""
  pos = np.arange(shard.loss_mask.shape[1])[None]
  first = np.where(shard.loss_mask.any(axis=1), shard.loss_mask.argmax(axis=1), shard.loss_mask.shape[1])[:, None]
  return int(np.sum(shard.valid & ~shard.loss_mask & (pos >= first)))
