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
  # an agent program, 'package.module:function' or 'path/to/file.py:function': `async def run(client, prompt_row)`
  # playing one episode through an openai.AsyncOpenAI client; returns its reward or its final answer; "": none
  agent: str = ""
  agent_workers: int = 4  # processes running agent episodes (a group's episodes share one, concurrently)
  agent_timeout_s: float = 300.0  # seconds an episode may take; past it the episode fails (scored 0, counted)
  agent_on_error: str = "zero"  # an episode that fails (raises, hangs, returns garbage): score it "zero", or "stop"

  def __post_init__(self):
    if self.environment:
      from streamrl_jax.envs.catalog import make_environment
      make_environment(self.environment, max_turns=self.max_turns)  # refuses an unknown name or turn limit
    if self.tool_threads < 1 or self.tool_delay_s < 0:
      raise ValueError("EnvConfig.tool_threads must be >= 1 and tool_delay_s >= 0")
    if self.agent:
      where, _, name = self.agent.rpartition(":")
      if not where or not name.isidentifier():
        raise ValueError(f"EnvConfig.agent={self.agent!r} is not 'package.module:function' or "
                         "'path/to/file.py:function'")
      if self.environment:
        raise ValueError(f"EnvConfig.agent and EnvConfig.environment={self.environment!r} both set: an agent "
                         "program calls its own tools; give one of them")
    if self.agent_workers < 1 or not self.agent_timeout_s > 0:
      raise ValueError("EnvConfig.agent_workers must be >= 1 and agent_timeout_s > 0")
    if self.agent_on_error not in ("zero", "stop"):
      raise ValueError(f"EnvConfig.agent_on_error={self.agent_on_error!r}; known: ['zero', 'stop']")
