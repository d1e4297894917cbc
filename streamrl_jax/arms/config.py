"""Algorithm arms: several trainers on one sample stream (`ArmsConfig`, a run's `ArmsConfig.followers`).

The run's own config is the lead arm: the samplers generate with its weights. Each follower arm trains a copy of
the same initial policy on every sample the lead receives, with its own advantage estimator, objective and
optimizer; everything that shapes the stream (model, task, batch, sampling, rewards) is the lead's. An arm is
written as a gin file (`streamrl ... --arms configs/arms/*.gin`), named by its file, holding only the keys it
changes; the config layer turns parsed files into `ArmConfig`s (`arm_files.arms_from_configs`) and refuses, naming
the arm, what cannot share a stream. A follower trains off-policy by construction (the lead's weights sampled), so its objective should
weigh each token by the behaviour probabilities: `arm_advice` warns of one that does not.
"""

from __future__ import annotations

import dataclasses
import re

from streamrl_jax.config_types import ConfigError
from streamrl_jax.run_shape import RunShape
from streamrl_jax.training import ADVANTAGES, ObjectiveConfig, OptimizerConfig, TrainerConfig

# Keys an arm may set differently from the lead: what its trainer does with the samples, not what is sampled.
ARM_KEYS = ("WorkflowConfig.advantage", "ObjectiveConfig.", "OptimizerConfig.", "PipelineConfig.seed")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class ArmConfig:
  """One follower trainer on the lead's stream: its name, and its own trainer settings."""

  name: str
  advantage: str = "grpo"  # the advantage estimator: grpo, dr_grpo, rloo or reinforce_pp
  objective: ObjectiveConfig = ObjectiveConfig()
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
  seed: int = 0

  def __post_init__(self):
    if not _NAME.match(self.name):
      raise ValueError(f"arm name {self.name!r}: letters, digits, '_', '.', '-' (a directory under WORKDIR/arms)")
    ADVANTAGES.get(self.advantage)


@dataclasses.dataclass(frozen=True)
class ArmsConfig:
  """A run's arms: its own trainer's name and the follower arms beside it, and how the followers run."""

  # follower arms: more trainers on this run's sample stream (`--arms FILES`, not gin)
  followers: tuple[ArmConfig, ...] = dataclasses.field(default=(), metadata={"bound_by": "--arms FILE.gin ..."})
  lead_name: str = "lead"  # with followers: this config's own trainer's name (its rows' `arm`)
  max_lag: int = 2  # a follower this many steps behind the lead skips a step to catch up
  # each follower is a program of its own (`streamrl follower`, reading its stream from the trainer's Flight
  # server); False: threads of the lead's program
  programs: bool = False

  def __post_init__(self):
    if self.max_lag < 0:
      raise ValueError(f"ArmsConfig.max_lag must be >= 0, got {self.max_lag}")
    if self.followers:
      check_arm_names(self.lead_name, self.followers)


def check_arm_names(lead: str, arms) -> None:
  """Refuses two arms of one name (the lead's included) and a name that is not a directory name."""
  seen = {lead}
  if not _NAME.match(lead):
    raise ConfigError(f"ArmsConfig.lead_name={lead!r}: letters, digits, '_', '.', '-'")
  for arm in arms:
    if arm.name in seen:
      raise ConfigError(f"two arms are named {arm.name!r}: each arm's outputs go to its own WORKDIR/arms/NAME")
    seen.add(arm.name)


def stream_settings(settings: dict) -> dict:
  """A run's flat settings without the keys an arm may change: what every arm of one stream shares."""
  return {k: v for k, v in settings.items() if not k.startswith(ARM_KEYS)}


def arm_trainer(trainer: TrainerConfig, arm: ArmConfig) -> TrainerConfig:
  """The lead's `TrainerConfig` as follower `arm` runs it: the arm's objective and optimizer; no stall limit (a
  follower waits on the lead, whose own watch stops the run)."""
  return dataclasses.replace(trainer, objective=arm.objective, optimizer=arm.optimizer,
                             wait=dataclasses.replace(trainer.wait, step_timeout_s=0.0))


def arm_shape(shape: RunShape, arm: ArmConfig) -> RunShape:
  """The lead's `RunShape` as follower `arm` runs it: the arm's advantage estimator and seed."""
  return dataclasses.replace(shape, advantage=arm.advantage, seed=arm.seed)


def lead_arm(arms: ArmsConfig, trainer: TrainerConfig, shape: RunShape) -> ArmConfig:
  """The lead's own trainer as an arm (`ArmsConfig.lead_name`): what it trains with, beside its followers."""
  return ArmConfig(arms.lead_name, shape.advantage, trainer.objective, trainer.optimizer, shape.seed)


def arm_advice(arms: ArmsConfig) -> list[str]:
  """A warning per follower whose objective ignores the behaviour (sampler) probabilities: its samples come from
  the lead's policy, and the mismatch then goes uncorrected every step."""
  return [f"arm {arm.name!r}: ObjectiveConfig.correction='none' with old_logprobs={arm.objective.old_logprobs!r} "
          f"ignores the sampler's probabilities, but a follower trains on the lead's samples (off-policy): a "
          f"correction ('token_tis', the default) weighs each token by them" for arm in arms.followers
          if not arm.objective.corrected]
