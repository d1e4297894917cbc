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


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased estimate of pass@k from `n` samples of which `c` are correct (Chen et al. 2021): the chance that
  k of the n, drawn without replacement, hold at least one correct, 1 - C(n - c, k) / C(n, k)."""
  if not 0 < k <= n or not 0 <= c <= n:
    raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def at_k(rewards_by_prompt, k: int) -> dict[str, float]:
  """`heldout_avg@K` (the mean share of a prompt's samples that are correct) and `heldout_pass@K` (`pass_at_k`,
  averaged over prompts) of each prompt's n >= k sampled rewards."""
  correct = [np.asarray(r, np.float64) >= CORRECT for r in rewards_by_prompt]
  return {f"heldout_avg@{k}": float(np.mean([c.mean() for c in correct])),
          f"heldout_pass@{k}": float(np.mean([pass_at_k(len(c), int(c.sum()), k) for c in correct]))}
