"""The held-out evaluation's rules, one place for every path (plain decoding, agent episodes, the step's row): its
prompts (drawn with a seed of their own, never used for training), how a scoring error names a prompt, and what
counts as correct (a reward of at least 1)."""

from __future__ import annotations

import numpy as np

from streamrl_jax.tasks.rows import Row, draw

SEED_OFFSET = 10_000  # the held-out draws' seed is the run's plus this: no training prompt stream shares it
CORRECT = 1.0  # a sample is correct when its reward reaches this


def heldout_prompts(task, count: int, seed: int) -> list[tuple[str, Row]]:
  """`count` (prompt, row) pairs of `task`, drawn for evaluation by the run of seed `seed`."""
  rng = np.random.default_rng(SEED_OFFSET + seed)
  return [draw(task, rng) for _ in range(count)]


def evaluation_where(prompt: str, row: Row) -> str:
  """Where a held-out prompt comes from, as a reward error names it."""
  return f"{row.where or 'prompt ' + repr(prompt[:40])} (evaluation)"


def accuracy(rewards) -> float:
  """The share of `rewards` that count as correct."""
  return float(np.mean(np.asarray(rewards, np.float64) >= CORRECT))
