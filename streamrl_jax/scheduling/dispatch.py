"""The dispatch of one step's requests over the engine instances, by the configured policy, and the
compiled slot count of a planned batch: pure functions of plain data."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from streamrl_jax.scheduling.config import SchedulingConfig
from streamrl_jax.scheduling.policies import DispatchPlan


@dataclasses.dataclass(frozen=True)
class StepDispatch:
  """Per request: the instance id it goes to; per instance id: its slot limit."""

  instance_of: tuple[int, ...]
  slot_limits: dict[int, int]
  plan: DispatchPlan


def dispatch_requests(config: SchedulingConfig, predicted: Sequence[float], history: Sequence[float],
                      instance_ids: Sequence[int], num_slots: int, seed: int = 0) -> StepDispatch:
  """Assigns every request (one entry of `predicted` each) to one of `instance_ids` by the config's
  registered policy."""
  ids = list(instance_ids)
  plan = config.scheduling_policy.plan(config, predicted, history, len(ids), num_slots, seed)
  instance_of = [0] * len(predicted)
  for k, requests in enumerate(plan.assignment):
    for r in requests:
      instance_of[r] = ids[k]
  return StepDispatch(tuple(instance_of), {ids[k]: b for k, b in enumerate(plan.batch_sizes)}, plan)


def engine_slots(batch: int, num_slots: int) -> int:
  """The compiled slot count for a planned batch: the next power of two, at most `num_slots`."""
  if batch < 1:
    raise ValueError(f"a planned batch must be >= 1, got {batch}")
  return min(num_slots, 1 << (batch - 1).bit_length())
