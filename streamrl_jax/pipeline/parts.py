"""How a run's whole config splits into what each part is built from: the one place the runner, the programs and
the tests take a part's setup from (`PipelineConfig` goes no further down)."""

from __future__ import annotations

from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.controller import ControllerSetup
from streamrl_jax.pipeline.sampler.worker import SamplerSetup
from streamrl_jax.pipeline.trainer.worker import TrainerSetup
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.workflow.pools import pool_meshes


def trainer_setup(config: PipelineConfig, spare: list = (), tokenizer=None) -> TrainerSetup:
  """A trainer worker's: its own config, the run's shape, the samplers' weight precision (`config` resolved first:
  `PipelineConfig.resolved`), the mesh's expert axis, the engine's cache length (the width it precompiles), the step
  graph and its own pools' meshes, cut from the `spare` devices (the program's that no mesh uses), and the policy's
  `tokenizer` (a judge's question is encoded with it)."""
  return TrainerSetup(config.trainer, config.shape, config.precision, config.mesh.expert_axis,
                      config.sampler.engine.cache_length, config.workflow, pool_meshes(config.workflow, list(spare)),
                      tokenizer)


def controller_setup(config: PipelineConfig) -> ControllerSetup:
  """The controller's: the run's shape, its own config, the scheduling policy and the engine's slots."""
  return ControllerSetup(config.shape, config.controller, config.scheduling, config.sampler.engine.num_slots)


def sampler_setup(config: PipelineConfig) -> SamplerSetup:
  """A sampler worker's: its side's config, the scheduling policy and the run's shape."""
  return SamplerSetup(config.sampler, config.scheduling, config.shape)


def plan_setup(config: PipelineConfig) -> PlanSetup:
  """A plan's (`streamrl plan`): the run's shape, the trainer's and engine's configs, the meshes' split, the
  scheduling and the samplers' precision (`config` resolved first: `PipelineConfig.resolved`)."""
  return PlanSetup(config.shape, config.trainer, config.sampler.engine, config.mesh, config.scheduling,
                   config.precision)
