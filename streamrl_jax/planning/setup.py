"""What a plan is built from (`PlanSetup`): the run's shape and the configs of the parts it compiles, split from the
whole run's config by the builders (`pipeline.parts.plan_setup`), as every part's own setup is."""

from __future__ import annotations

import dataclasses

from streamrl_jax.meshes import MeshConfig
from streamrl_jax.models.precision import SamplerPrecision
from streamrl_jax.run_shape import RunShape
from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.scheduling.config import SchedulingConfig
from streamrl_jax.training import TrainerConfig


@dataclasses.dataclass(frozen=True)
class PlanSetup:
  """The run's shape, its trainer's and engine's configs, its meshes' split, its scheduling, and the samplers' weight
  precision (resolved: no 'auto')."""

  shape: RunShape
  trainer: TrainerConfig
  engine: EngineConfig
  mesh: MeshConfig
  scheduling: SchedulingConfig
  precision: SamplerPrecision
