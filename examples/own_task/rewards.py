"""The worked example's rewards: the right number, and the answer given with its unit.

Each is a plain function `fn(prompt, completion, **fields) -> float`; `answer` and `unit` are columns of
problems.jsonl. Named in own_task.gin as 'examples/own_task/rewards.py:correct' and '...:states_unit'.
"""

import re


def _last_number(text: str):
  found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
  return float(found[-1].replace(",", "")) if found else None


def correct(prompt: str, completion: str, answer, **fields) -> float:
  """1.0 when the last number in the completion is the answer."""
  return float(_last_number(completion) == float(answer))


def states_unit(prompt: str, completion: str, answer, unit: str, **fields) -> float:
  """1.0 when the completion says the answer followed by its unit ("56 liters"), else 0.0."""
  return float(re.search(rf"(?<![\d.]){answer}\s+{re.escape(unit)}\b", completion, re.IGNORECASE) is not None)
