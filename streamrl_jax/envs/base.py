"""The environment protocol of multi-turn rollouts, and the registry gin picks environments from.

An episode starts from a task's prompt (`reset(prompt, seed) -> state`). The model writes a turn; a turn that
ends with the environment's `stop` text (a tool call) goes to `step(state, turn) -> (state, Observation)`, whose
text is appended to the same row (with loss mask 0) before the model goes on; a turn that ends otherwise (the
end-of-sequence token, the token budget) ends the episode, and the task's reward scores the whole transcript.
`step` is pure: the state is a frozen record, so an episode replays identically from its seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from streamrl_jax.registry import Registry

ENVIRONMENTS = Registry("environment")


@dataclasses.dataclass(frozen=True)
class Observation:
  text: str  # appended to the row after the model's turn ("" appends nothing)
  reward: float = 0.0  # added to the task's reward of the episode
  done: bool = False  # the episode ends here (the observation is not appended)


class Environment(Protocol):
  stop: str  # a turn ending with this text is a tool call

  def reset(self, prompt: str, seed: int) -> Any: ...

  def step(self, state: Any, turn: str) -> tuple[Any, Observation]: ...
