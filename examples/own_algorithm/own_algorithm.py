"""Your own RL algorithm as a step graph, with no change to streamrl_jax: GRPO's step with two stages of your own.

`shape` cuts the reward of a completion that runs past a token budget (DAPO's soft overlong punishment), and
`advantage` ranks each sample within its group (ties share their rank), so the update sees an advantage in
[-1, 1] whatever the reward's scale. Each stage is a plain function of numpy arrays: its inputs, in order, then its
params as keywords; the flow checks what it returns (shape, finite numbers) before the trainer sees it. Both read
per-sample fields only, so the graph runs unchanged on a trainer of several processes.
WorkflowConfig.graph = 'examples/own_algorithm/own_algorithm.py:GRAPH' picks it (own_algorithm.gin)."""

import numpy as np
from scipy.stats import rankdata

from streamrl_jax.workflow import Stage, StepGraph
from streamrl_jax.workflow.graphs import GENERATE, REWARD, UPDATE

HERE = __file__  # the stages' functions are found in this file, wherever the run starts


def overlong_penalty(rewards, completion_lengths, *, budget, coef):
  """The reward less `coef` per completion token past `budget`."""
  return rewards - coef * np.maximum(completion_lengths - budget, 0)


def rank_advantage(rewards, group_ids):
  """Each sample's rank within its group, mapped to [-1, 1] (0 for a group of equal rewards)."""
  out = np.zeros(len(rewards), np.float32)
  for group in np.unique(group_ids):
    rows = np.flatnonzero(group_ids == group)
    ranks = rankdata(rewards[rows])  # 1..n, ties averaged
    out[rows] = (2 * ranks - len(rows) - 1) / max(len(rows) - 1, 1)
  return out


GRAPH = StepGraph("overlong_rank", (
    GENERATE,  # the sampler: tokens, valid, loss_mask, logprobs, group_ids, completion_lengths
    REWARD,  # the sampler: the task's verifier, or RewardConfig.functions -> rewards
    Stage("shape", f"{HERE}:overlong_penalty", ("rewards:sample", "completion_lengths:sample"), ("shaped:sample",),
          params=(("budget", 24), ("coef", 0.02))),
    Stage("advantage", f"{HERE}:rank_advantage", ("shaped:sample", "group_ids:group"), ("advantages:sample",)),
    UPDATE,  # the trainer: the policy loss (ObjectiveConfig) on the advantages
))
