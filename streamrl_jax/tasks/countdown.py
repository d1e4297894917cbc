"""Countdown: reach a target from given numbers with + - * /, each number used at most once.

Prompt `3,5,7->22:`; a correct completion is `3*5+7`. Expressions are parsed with `ast` (never eval'd).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from collections import Counter
from fractions import Fraction

import numpy as np

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node, used: list[int]) -> Fraction:
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    left, right = _evaluate(node.left, used), _evaluate(node.right, used)
    if isinstance(node.op, ast.Div) and right == 0:
      raise ZeroDivisionError
    return _OPS[type(node.op)](left, right)
  if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
    used.append(node.value)
    return Fraction(node.value)
  raise ValueError("only integers and + - * / are allowed")


def countdown_reward(prompt: str, completion: str, **fields) -> float:
  """1.0 if the completion's expression uses only the prompt's numbers (each at most as often as given)
  and equals the target exactly, else 0.0."""
  match = re.fullmatch(r"([\d,]+)->(\d+):", prompt.strip())
  if match is None:
    raise ValueError(f"not a countdown prompt: {prompt!r}")
  numbers, target = Counter(int(x) for x in match.group(1).split(",")), int(match.group(2))
  used: list[int] = []
  try:
    value = _evaluate(ast.parse(completion.strip(), mode="eval").body, used)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
    return 0.0
  return float(value == target and not Counter(used) - numbers)


@dataclasses.dataclass(frozen=True)
class CountdownTask:
  count: int = 3
  max_number: int = 10

  def sample(self, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, one solution): the target is built from a random expression over the numbers."""
    numbers = [int(x) for x in rng.integers(1, self.max_number + 1, self.count)]
    expression = str(numbers[0])
    for n in numbers[1:]:
      op = "+*-"[int(rng.integers(0, 3))]
      candidate = f"{expression}{op}{n}"
      if countdown_value(candidate) > 0:
        expression = candidate
      else:
        expression = f"{expression}+{n}"
    return f"{','.join(map(str, numbers))}->{countdown_value(expression)}:", expression

  ROW_FIELDS = {"answer": "the target the expression must reach, as text",
                "numbers": "the numbers to use, comma-separated", "solution": "one expression that reaches it"}

  @staticmethod
  def row_fields(prompt: str, solution: str) -> dict:
    numbers, _, target = prompt.rstrip(":").partition("->")
    return {"answer": target, "numbers": numbers, "solution": solution}

  @staticmethod
  def reward(prompt: str, completion: str, **fields) -> float:
    return countdown_reward(prompt, completion)


def countdown_value(expression: str) -> int:
  value = _evaluate(ast.parse(expression, mode="eval").body, [])
  return int(value)
