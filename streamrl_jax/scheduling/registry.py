"""Scheduling policies by name: what each one dispatches, how an instance admits its queue, and whether it
needs the output-length ranker. Code asks the registered policy; it never compares policy names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from streamrl_jax.registry import Registry
from streamrl_jax.scheduling.policies import (DispatchPlan, PTLCurve, fifo_order, longest_first_admission,
                                              random_dispatch, skew_aware_dispatch)

# (scheduling config, predicted lengths, recent realised lengths, instances, slots per instance, seed) -> plan
PlanFn = Callable[..., DispatchPlan]
AdmissionOrder = Callable[[Sequence], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class SchedulingPolicy:
  """A scheduling policy: its dispatch plan, the admission order inside an instance, and whether it needs the
  ranker's predictions (then the controller also cuts a step's leases by the plan)."""

  name: str
  plan: PlanFn
  admission: AdmissionOrder
  needs_ranker: bool


SCHEDULING_POLICIES = Registry("scheduling policy")


class PlanConfig(Protocol):
  """What a plan reads of its `SchedulingConfig`: a protocol, since `scheduling.config` imports this registry."""

  @property
  def alpha(self) -> float: ...

  @property
  def curve(self) -> PTLCurve: ...


def _random_plan(config: PlanConfig, predicted, history, instances: int, slots: int, seed: int) -> DispatchPlan:
  return random_dispatch(len(predicted), instances, slots, seed)


def _skew_aware_plan(config: PlanConfig, predicted, history, instances: int, slots: int, seed: int) -> DispatchPlan:
  """The long-tail and rest mean lengths come from `history` (P90 and P50 of recent realised lengths) when
  there is any, else from the predictions themselves."""
  history = np.asarray(history, float)
  lengths = dict(long_mean_len=float(np.percentile(history, 90)),
                 short_mean_len=float(np.percentile(history, 50))) if history.size else {}
  return skew_aware_dispatch(predicted, instances, slots, config.curve, alpha=config.alpha, **lengths)


SCHEDULING_POLICIES.register("fifo")(SchedulingPolicy("fifo", _random_plan, fifo_order, needs_ranker=False))
SCHEDULING_POLICIES.register("skew_aware")(
    SchedulingPolicy("skew_aware", _skew_aware_plan, longest_first_admission, needs_ranker=True))
