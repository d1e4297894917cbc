"""The multi-turn configuration: which environment the samples call as a tool, and how its calls run."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Which environment the samples call as a tool in multi-turn episodes, and how its calls run."""

  environment: str = ""  # an `envs` environment the samples call as a tool: "calculator"; "": none (single-turn)
  max_turns: int = 2  # tool calls per episode
  tool_threads: int = 64  # host threads running tool calls; with at least the engine slots, calls never queue
  tool_delay_s: float = 0.0  # seconds added to every tool call (to measure slow tools)

  def __post_init__(self):
    if self.environment:
      from streamrl_jax.envs.catalog import make_environment
      make_environment(self.environment, max_turns=self.max_turns)  # refuses an unknown name or turn limit
    if self.tool_threads < 1 or self.tool_delay_s < 0:
      raise ValueError("EnvConfig.tool_threads must be >= 1 and tool_delay_s >= 0")
