"""What the running pipeline asks of scheduling, as pure functions of plain data: the dispatch of one
step's requests over the engine instances, and the elastic target instance count."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from streamrl_jax.scheduling.policies import (DispatchPlan, elastic_decision, ptl_at, random_dispatch,
                                              skew_aware_dispatch)
from streamrl_jax.scheduling.ranker import RankerConfig

POLICIES = ("fifo", "skew_aware")
# Seconds per decode step by batch size, measured on the 2-core CPU this project is developed on with
# the ~10M-parameter benchmark model (`python benchmarks/sampler.py`, ptl_ms_by_batch). Set your own
# model's, from `streamrl_jax.sampling.measure_ptl_curve`.
CPU_PTL_CURVE = ((1, 0.0053), (2, 0.0056), (4, 0.0067), (8, 0.0083), (16, 0.0110), (32, 0.0178))


@dataclasses.dataclass(frozen=True)
class SchedulingConfig:
  """How the sampler dispatches and admits requests, and whether it grows or shrinks.

  policy      "fifo": requests dealt at random over the instances, admitted in arrival order, every
              instance at full batch; "skew_aware": the ranker's predicted-longest `alpha` share goes
              to long-tail instances sized by the latency model, admission is longest-first.
  instances   engine instances (sampler replicas) at start; the sampler mesh is cut into
              `max_instances` equal sub-meshes (0: as many as `instances`).
  elastic     add or remove a replica between steps when generation and training times diverge
              (`elastic_decision`), between `min_instances` and `max_instances`.
  resize_engines  run each replica on an engine compiled for its planned batch size (rounded up to a
              power of two; one more compile per new size) instead of capping the busy slots of the
              full-size engine: a static-shape decode step costs its compiled slot count, busy or not.
  """

  policy: str = "fifo"
  instances: int = 1
  max_instances: int = 0
  min_instances: int = 1
  elastic: bool = False
  alpha: float = 0.2
  hysteresis: float = 0.05
  resize_engines: bool = True
  ptl_curve: tuple[tuple[int, float], ...] = CPU_PTL_CURVE
  ranker: RankerConfig = RankerConfig()

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"SchedulingConfig.policy={self.policy!r}; known: {list(POLICIES)}")
    if not 0 < self.alpha < 1:
      raise ValueError(f"SchedulingConfig.alpha must be in (0, 1), got {self.alpha}")
    if not self.ptl_curve:
      raise ValueError("SchedulingConfig.ptl_curve is empty: the latency model needs (batch, seconds) points")
    ptl_at(self.curve, 1)  # validates the points
    if not 1 <= self.min_instances <= self.instances <= self.instance_limit:
      raise ValueError(f"need 1 <= min_instances ({self.min_instances}) <= instances ({self.instances}) <= "
                       f"max_instances ({self.instance_limit})")
    if self.hysteresis < 0:
      raise ValueError(f"SchedulingConfig.hysteresis must be >= 0, got {self.hysteresis}")

  @property
  def instance_limit(self) -> int:
    """Sub-meshes the sampler mesh is cut into: the most replicas that can run."""
    return self.max_instances or self.instances

  @property
  def curve(self) -> dict[int, float]:
    return {int(b): float(s) for b, s in self.ptl_curve}


@dataclasses.dataclass(frozen=True)
class StepDispatch:
  """Per request: the instance id it goes to; per instance id: its slot limit."""

  instance_of: tuple[int, ...]
  slot_limits: dict[int, int]
  plan: DispatchPlan


def dispatch_requests(config: SchedulingConfig, predicted: Sequence[float], history: Sequence[float],
                      instance_ids: Sequence[int], num_slots: int, seed: int = 0) -> StepDispatch:
  """Assigns every request (one entry of `predicted` each) to one of `instance_ids`.

  skew_aware estimates the long-tail and rest mean lengths from `history` (P90 and P50 of recent
  realised lengths) when there is any, else from the predictions themselves.
  """
  ids = list(instance_ids)
  if config.policy == "fifo":
    plan = random_dispatch(len(predicted), len(ids), num_slots, seed)
  else:
    history = np.asarray(history, float)
    lengths = dict(long_mean_len=float(np.percentile(history, 90)),
                   short_mean_len=float(np.percentile(history, 50))) if history.size else {}
    plan = skew_aware_dispatch(predicted, len(ids), num_slots, config.curve, alpha=config.alpha, **lengths)
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


def elastic_target(config: SchedulingConfig, current: int, gen_s: float, train_s: float) -> int:
  """The instance count for the next step: generation time is assumed to scale as 1 / instances, so one
  more replica saves gen_s / (n + 1) and one fewer costs gen_s / (n - 1)."""
  if not config.elastic:
    return current
  saved = gen_s / (current + 1)
  lost = gen_s / (current - 1) if current > 1 else float("inf")
  step = elastic_decision(gen_s, train_s, saved, lost, hysteresis=config.hysteresis)
  return int(np.clip(current + step, config.min_instances, config.instance_limit))
