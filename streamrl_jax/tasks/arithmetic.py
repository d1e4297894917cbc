"""Multi-digit addition with digit-by-digit working: output length grows with the number of digits, and
digit counts are drawn long-tailed, so output lengths are skewed like reasoning traces.

Prompt `47+85=`; worked solution `7+5=12;4+8+1=13;=132` (each step: the column's digits, the carry in,
their sum; the final answer after the last `;=`).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_FINAL = re.compile(r";=(\d+)$")


def worked_solution(a: int, b: int) -> str:
  """The step-by-step working whose final answer is a + b."""
  da, db = str(a)[::-1], str(b)[::-1]
  steps, carry = [], 0
  for i in range(max(len(da), len(db))):
    terms = [int(d[i]) for d in (da, db) if i < len(d)] + ([carry] if carry else [])
    total = sum(terms)
    steps.append("+".join(map(str, terms)) + f"={total}")
    carry = total // 10
  return ";".join(steps) + f";={a + b}"


def arithmetic_reward(prompt: str, completion: str, **fields) -> float:
  """1.0 when the completion ends in `;=` and the right sum, else 0.0 (the working itself is not graded)."""
  match = re.fullmatch(r"(\d+)\+(\d+)=", prompt.strip())
  if match is None:
    raise ValueError(f"not an arithmetic prompt: {prompt!r}")
  found = _FINAL.search(completion.strip())
  return float(found is not None and int(found.group(1)) == int(match.group(1)) + int(match.group(2)))


def digit_count_probabilities(max_digits: int, exponent: float) -> np.ndarray:
  """P(d digits) proportional to d ** -exponent for d = 1..max_digits: a long tail of long problems."""
  if max_digits < 1 or exponent < 0:
    raise ValueError(f"need max_digits >= 1 and exponent >= 0, got {max_digits}, {exponent}")
  weights = np.arange(1, max_digits + 1, dtype=float) ** -exponent
  return weights / weights.sum()


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  max_digits: int = 8
  tail_exponent: float = 1.5

  def sample(self, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, worked solution) with both operands of a long-tailed number of digits."""
    digits = rng.choice(np.arange(1, self.max_digits + 1), p=digit_count_probabilities(self.max_digits,
                                                                                       self.tail_exponent))
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits
    a, b = (int(rng.integers(low, high)) for _ in range(2))
    return f"{a}+{b}=", worked_solution(a, b)

  ROW_FIELDS = {"answer": "the sum, as text", "solution": "the worked solution the warm-up trains on"}

  @staticmethod
  def row_fields(prompt: str, solution: str) -> dict:
    return {"answer": solution.rpartition(";=")[2], "solution": solution}

  @staticmethod
  def reward(prompt: str, completion: str, **fields) -> float:
    return arithmetic_reward(prompt, completion)
