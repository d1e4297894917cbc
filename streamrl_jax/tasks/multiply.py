"""Multi-digit multiplication, a task where a calculator tool matters: a small model cannot multiply in its
head, but it can learn to hand the problem to the calculator (`envs.calculator_env`) and copy the answer.

Prompt `3457*29=`. With the tool, a worked solution is a call and the answer: `<3457*29>100253;=100253`,
where `100253` after the call is the calculator's output (in a rollout the environment writes it, with loss
mask 0). Without (`tool=False`), the worked solution is the answer alone: `;=100253`. Reward 1.0 when the
completion ends with `;=` and the right product.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_FINAL = re.compile(r";=(-?\d+)$")
_PROMPT = re.compile(r"(\d+)\*(\d+)=")


def multiply_reward(prompt: str, completion: str, **fields) -> float:
  match = _PROMPT.fullmatch(prompt.strip())
  if match is None:
    raise ValueError(f"not a multiplication prompt: {prompt!r}")
  found = _FINAL.search(completion.strip())
  return float(found is not None and int(found.group(1)) == int(match.group(1)) * int(match.group(2)))


@dataclasses.dataclass(frozen=True)
class MultiplyTask:
  digits: int = 3  # of each factor, at most
  tool: bool = True  # worked solutions call the calculator

  def sample(self, rng: np.random.Generator) -> tuple[str, str]:
    a, b = (int(rng.integers(10 ** (int(rng.integers(1, self.digits + 1)) - 1), 10 ** self.digits)) for _ in range(2))
    answer = f";={a * b}"
    return f"{a}*{b}=", (f"<{a}*{b}>{a * b}" if self.tool else "") + answer

  ROW_FIELDS = {"answer": "the product, as text",
                "solution": "the worked solution the warm-up trains on: a calculator call (task 'multiply' only), "
                            "then ';=' and the answer"}

  @staticmethod
  def row_fields(prompt: str, solution: str) -> dict:
    return {"answer": solution.rpartition(";=")[2], "solution": solution}

  @staticmethod
  def reward(prompt: str, completion: str, **fields) -> float:
    return multiply_reward(prompt, completion)
