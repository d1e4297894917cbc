"""What every part of a run must agree on (`RunShape`): its mode, length, batch shape and sampling distribution.

Each part is built from its own config and this record; only the places that build the parts (the runner, each
program's entry, the job, the preflight, the config layer and the CLI) read the whole pipeline config.
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.modes import ModeSpec


@dataclasses.dataclass(frozen=True)
class RunShape:
  """The run's shape, set once from `PipelineConfig` (`PipelineConfig.shape`)."""

  mode: str  # colocated, disaggregated, stream or async
  steps: int  # RL steps of the run
  prompts_per_step: int  # prompts drawn per step
  group_size: int  # samples per prompt
  max_new_tokens: int  # tokens generated per sample at most
  max_prompt_length: int  # prompt tokens per sample at most (the engine's)
  staleness: int  # async: versions a batch's weights may lag
  seed: int  # the run's seed
  temperature: float  # the sampling temperature the trainer scores at
  top_k: int  # the sampler's top-k (0: off); the trainer rebuilds the same support
  top_p: float  # the sampler's top-p (1: off)
  min_p: float  # the sampler's min-p (0: off)
  advantage: str  # the advantage estimator's name
  reward_names: tuple[str, ...]  # the reward functions' names, in the order samples carry their scores
  backfill_per_step: int  # the most prompts dynamic sampling adds to a step (0 when it is off)

  @property
  def samples_per_step(self) -> int:
    return self.prompts_per_step * self.group_size

  @property
  def longest(self) -> int:
    """The longest sample: a full prompt and every new token."""
    return self.max_prompt_length + self.max_new_tokens

  @property
  def spec(self) -> ModeSpec:
    return ModeSpec.of(self.mode, self.staleness)
