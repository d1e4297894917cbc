"""What each built-in task's prompts and rows hold, and which function scores it: `streamrl tasks` and
docs/own_task.md's table."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from streamrl_jax.tasks.config import TASKS, TaskConfig
from streamrl_jax.tasks.rows import draw

REWARDS = {"arithmetic": "streamrl_jax.tasks.arithmetic:arithmetic_reward",
           "countdown": "streamrl_jax.tasks.countdown:countdown_reward",
           "sums": "streamrl_jax.tasks.sums:sums_reward",
           "multiply": "streamrl_jax.tasks.multiply:multiply_reward",
           "multiply_no_tool": "streamrl_jax.tasks.multiply:multiply_reward"}
FILE_FIELDS = ("your rows' columns: every one but TaskConfig.prompt_key reaches the reward functions, as the file "
               "holds it")


class TaskListing(NamedTuple):
  """One built-in task: an example prompt, its row's fields (name -> (example value, what it holds)), its reward."""
  name: str
  prompt: str
  fields: dict[str, tuple[object, str]]
  reward: str


def built_in_tasks(seed: int = 0) -> list[TaskListing]:
  """Every built-in task (TaskConfig's defaults), with one prompt and row drawn at `seed`."""
  out = []
  for name in TASKS:
    if name == "file":
      continue
    task = TaskConfig(name=name).make_task()
    prompt, row = draw(task, np.random.default_rng(seed))
    out.append(TaskListing(name, prompt, {k: (v, task.ROW_FIELDS[k]) for k, v in row.fields.items()},
                           REWARDS[name]))
  return out


def lines() -> list[str]:
  """`streamrl tasks`: each task's example prompt, row fields with an example value each, and its reward."""
  out = []
  for task in built_in_tasks():
    out.append(f"{task.name}: prompt {task.prompt!r}; scored by {task.reward}")
    out.extend(f"  {key} = {value!r}  # {meaning}" for key, (value, meaning) in task.fields.items())
  out.append(f"file: {FILE_FIELDS} (docs/own_task.md)")
  return out


def markdown() -> str:
  """docs/own_task.md's table of the built-in tasks' row fields."""
  rows = ["| task | example prompt | row field = example | scored by |", "|---|---|---|---|"]
  for task in built_in_tasks():
    fields = "<br>".join(f"`{k}` = `{v!r}`: {meaning}" for k, (v, meaning) in task.fields.items())
    rows.append(f"| `{task.name}` | `{task.prompt!r}` | {fields} | `{task.reward}` |")
  return "\n".join(rows)
