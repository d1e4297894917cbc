"""Sums asked in words, for chat models: `What is 47 + 85? Reply with only the number.`

Held-out split: the pair (a, b) is held out when the CRC-32 of `a+b` is 0 mod 5 (a fifth of all pairs);
the training split never draws a held-out pair, so evaluation measures what training did not see.

Reward rule: 1.0 when the completion's last integer (commas between digits removed, a leading minus kept)
equals the sum, else 0.0. The format is reported apart (`format_ok`: the completion is the number alone),
never rewarded.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np

_QUESTION = re.compile(r"What is (\d+(?: \+ \d+)+)\? Reply with only the number\.")
_INTEGER = re.compile(r"-?\d+")
SPLITS = ("train", "heldout")


def is_heldout(terms: tuple[int, ...]) -> bool:
  return zlib.crc32("+".join(map(str, terms)).encode()) % 5 == 0


def last_integer(text: str) -> int | None:
  found = _INTEGER.findall(re.sub(r"(?<=\d),(?=\d)", "", text))
  return int(found[-1]) if found else None


def sums_reward(prompt: str, completion: str, **fields) -> float:
  match = _QUESTION.fullmatch(prompt.strip())
  if match is None:
    raise ValueError(f"not a sums prompt: {prompt!r}")
  return float(last_integer(completion) == sum(int(t) for t in match.group(1).split(" + ")))


def format_ok(completion: str) -> bool:
  """The completion is one integer and nothing else (white space aside)."""
  return re.fullmatch(r"\s*-?\d[\d,]*\s*", completion) is not None


@dataclasses.dataclass(frozen=True)
class SumsTask:
  digits: int = 2  # digits of each term
  terms: int = 2
  split: str = "train"

  def __post_init__(self):
    if self.split not in SPLITS:
      raise ValueError(f"SumsTask.split={self.split!r}; known: {list(SPLITS)}")
    if self.digits < 1 or self.terms < 2:
      raise ValueError(f"SumsTask needs digits >= 1 and terms >= 2, got {self.digits}, {self.terms}")

  def sample(self, rng: np.random.Generator) -> tuple[str, str]:
    """(question, answer) from this task's split."""
    low, high = (0 if self.digits == 1 else 10 ** (self.digits - 1)), 10**self.digits
    while True:
      terms = tuple(int(x) for x in rng.integers(low, high, self.terms))
      if is_heldout(terms) == (self.split == "heldout"):
        return f"What is {' + '.join(map(str, terms))}? Reply with only the number.", str(sum(terms))

  ROW_FIELDS = {"answer": "the sum, as text"}

  @staticmethod
  def row_fields(prompt: str, solution: str) -> dict:
    return {"answer": solution}

  @staticmethod
  def reward(prompt: str, completion: str, **fields) -> float:
    return sums_reward(prompt, completion)
