"""A prompt's dataset row: where it comes from (named in errors) and its other columns (handed to the rewards).

A row travels with its prompt in a `Lease` (JSON) from the controller to the sampler that scores it; it never
reaches the trainer.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Row:
  where: str = ""  # "data.jsonl row 12"; "" for a generated prompt
  fields: dict = dataclasses.field(default_factory=dict)  # the row's columns other than the prompt

  def to_json(self) -> str:
    return json.dumps({"where": self.where, "fields": self.fields}, ensure_ascii=False, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Row:
    """The row a lease carries; a malformed one is refused naming what is wrong."""
    try:
      obj = json.loads(text)
    except (TypeError, json.JSONDecodeError) as err:
      raise ValueError(f"a lease's row is not JSON: {str(err)[:80]}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("where"), str) or not isinstance(obj.get("fields"), dict):
      raise ValueError(f"a lease's row must be {{'where': str, 'fields': object}}, got {str(text)[:80]!r}")
    return cls(obj["where"], obj["fields"])


def draw(task, rng) -> tuple[str, Row]:
  """One prompt of `task` and its row: a task's own `draw`, else the fields its `row_fields` makes of the prompt and
  `sample`'s solution (`ROW_FIELDS` says what each holds), else that solution as the row's `answer`."""
  if hasattr(task, "draw"):
    return task.draw(rng)
  prompt, solution = task.sample(rng)
  return prompt, Row(fields=task.row_fields(prompt, solution) if hasattr(task, "row_fields") else {"answer": solution})


def question(task, prompt: str) -> str:
  """The prompt as the task wrote it (a chat task's template taken off): what reward functions see."""
  return task.question(prompt) if hasattr(task, "question") else prompt


def prompt_tokens(task, tokenizer, prompt: str) -> list[int]:
  """The ids of one of `task`'s prompts: a chat task's prompt is rendered text that holds its special tokens
  (encoded as it is); a raw prompt gets the ones the tokenizer adds (`encode_prompt`: BOS for Llama tokenizers)."""
  return task.encode(tokenizer, prompt) if hasattr(task, "encode") else tokenizer.encode_prompt(prompt)


def verifier(task) -> Callable[[str, str, dict], float]:
  """The task's own reward as fn(question, completion, fields), the question as `question(task, prompt)` gives it
  (what the scorer hands every reward): a chat task's inner task scores it. The fields go to a `reward` that
  takes **fields."""
  inner = getattr(task, "inner_task", None)
  if inner is not None:
    return verifier(inner)
  try:
    takes = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(task.reward).parameters.values())
  except (TypeError, ValueError):
    takes = False
  if takes:
    return lambda prompt, completion, fields: task.reward(prompt, completion, **fields)
  return lambda prompt, completion, fields: task.reward(prompt, completion)
