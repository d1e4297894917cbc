"""The controller's configuration, the same in one process and across processes: how often samplers beat, when
a silent one is lost, how long the trainer waits for samplers, the shape of the weights' broadcast tree, and
whether it plans more prompts for a step whose groups carry no signal (dynamic sampling)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  heartbeat_s: float = 2.0  # a sampler's heartbeat period
  lease_timeout_s: float = 10.0  # a sampler silent this long is declared lost; its leases go to the others
  sampler_timeout_s: float = 600.0  # no sampler heard from this long (or a step's reports missing): the run stops
  finish_grace_s: float = 15.0  # after the last step: how long the trainer waits for samplers to learn it
  weight_fanout: int = 1  # children per node of a version's broadcast tree (1: a chain, best when links are equal)
  # DAPO's dynamic sampling: a group whose rewards are all equal is not trained; the step is filled with more
  # prompts, up to `backfill_limit`
  dynamic_sampling: bool = False
  backfill_limit: int = 0  # dynamic sampling: most prompts added to a step; 0: PipelineConfig.prompts_per_step

  def __post_init__(self):
    for name in ("heartbeat_s", "lease_timeout_s", "sampler_timeout_s", "finish_grace_s", "weight_fanout"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ControllerConfig.{name} must be > 0, got {getattr(self, name)}")
    if self.backfill_limit < 0:
      raise ValueError(f"ControllerConfig.backfill_limit must be >= 0 (0: prompts_per_step), got "
                       f"{self.backfill_limit}")
    if self.lease_timeout_s <= self.heartbeat_s:
      raise ValueError(f"ControllerConfig.lease_timeout_s ({self.lease_timeout_s}) must exceed heartbeat_s "
                       f"({self.heartbeat_s}), or every sampler would be declared lost between two beats")
