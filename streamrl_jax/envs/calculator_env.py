"""The calculator environment: a tool call is `<EXPR>` at the end of a model turn, and the observation is
the value of EXPR (`envs.calculator`, a whitelisted `ast` walk) or `error: WHY`. E.g. the model writes
`<3457*29>`, the row goes on with `100253` (loss mask 0), and the model writes `;=100253`. After `max_turns`
calls the episode ends."""

from __future__ import annotations

import dataclasses

from streamrl_jax.envs.base import ENVIRONMENTS, Observation
from streamrl_jax.envs.calculator import CalculatorError, evaluate, format_value

CALL_OPEN, CALL_CLOSE = "<", ">"


@dataclasses.dataclass(frozen=True)
class CalculatorState:
  turns: int = 0


def parse_call(turn: str) -> str | None:
  """The expression of the tool call that ends `turn` (`...<EXPR>`), or None."""
  if not turn.endswith(CALL_CLOSE) or CALL_OPEN not in turn:
    return None
  return turn[turn.rindex(CALL_OPEN) + 1:-1]


@ENVIRONMENTS.register("calculator")
@dataclasses.dataclass(frozen=True)
class CalculatorEnv:
  max_turns: int = 2
  stop: str = CALL_CLOSE

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError(f"calculator max_turns must be >= 1, got {self.max_turns}")

  def reset(self, prompt: str, seed: int) -> CalculatorState:
    return CalculatorState()

  def step(self, state: CalculatorState, turn: str) -> tuple[CalculatorState, Observation]:
    if state.turns >= self.max_turns:
      return state, Observation("", done=True)
    expression = parse_call(turn)
    if expression is None:
      return dataclasses.replace(state, turns=state.turns + 1), Observation("error: no call")
    try:
      text = format_value(evaluate(expression))
    except CalculatorError as err:
      text = f"error: {err}"
    return dataclasses.replace(state, turns=state.turns + 1), Observation(text)
