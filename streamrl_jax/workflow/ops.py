"""What a stage does (`Op`): a role's own program (the sampler generates and scores, the trainer updates), or a
function of arrays the flow calls (built-in by name, the user's by import path), maybe scoring with a frozen model.

A function stage is called as `fn(*inputs, **params)` with its inputs' arrays in order, and may also take any of
the flow's keywords (`FLOW_KEYWORDS`: the run's advantage `estimator`, the policy loss's `objective`, the op's
frozen `model`, and on a trainer of several processes `owners`: each sample's process, which alone holds its
tokens); it returns its output's array, or a tuple of them in the order of its outputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from streamrl_jax.registry import Registry
from streamrl_jax.rewards.functions import RewardFunctionError, load_function
from streamrl_jax.training import compute_advantages, kl_penalized_rewards
from streamrl_jax.training.advantages import gae
from streamrl_jax.workflow.graph import GraphError

FLOW_KEYWORDS = ("estimator", "objective", "model", "owners")


@dataclasses.dataclass(frozen=True)
class Op:
  """`fn` None: the program of role `role` ('sampler' or 'trainer') runs it, with its fixed ports (`inputs`,
  `outputs`); else a function of arrays, scoring with the frozen `model` where one is named."""

  fn: Callable | None = None
  role: str = ""
  model: str = ""
  inputs: tuple[str, ...] = ()
  outputs: tuple[str, ...] = ()


OPS = Registry("stage op")


def group_advantage(rewards, group_ids, *, estimator):
  """One advantage per sample from its group's rewards (`training.advantages`, by `estimator`)."""
  return compute_advantages(estimator, rewards, group_ids)


def kl_penalty(rewards, logprobs, reference_logprobs, loss_mask, *, objective):
  """r - coef * the sample's summed KL of the sampler's tokens to the reference (`ObjectiveConfig.kl_coef`,
  `kl_estimator`): the 'KL in the reward' variant."""
  return np.asarray(kl_penalized_rewards(rewards, logprobs, reference_logprobs, loss_mask, objective.kl_coef,
                                         objective.kl_estimator), np.float32)


def reverse_kl(logprobs, teacher_logprobs, loss_mask):
  """On-policy distillation's per-token advantage: log p_teacher(x_t) - log p_student(x_t) of each sampled token, the
  negated single-sample estimate of the reverse KL (student || teacher); 0 off the loss mask."""
  return np.where(loss_mask, np.asarray(teacher_logprobs, np.float32) - np.asarray(logprobs, np.float32), 0.0)


def model_scores(tokens, valid, *, model, owners=None):
  """A model's scores of each sample: log p of each token ([rows, T]; column 0 is 0) for a reference or a teacher, a
  judge's p(yes) / (p(yes) + p(no)) after the judge question ([rows]), a critic's values ([rows, T]); with `owners`,
  each sample scored on its owner's devices, every process given every score."""
  return model(tokens, valid) if owners is None else model(tokens, valid, owners)


def token_gae(rewards, values, loss_mask, *, gamma: float = 1.0, lam: float = 1.0):
  """PPO's (advantages, returns) per token by generalised advantage estimation (`training.advantages.gae`) over each
  sample's loss tokens in order, its reward on the last one, `values` the critic's of the state before each token; a
  multi-turn sample's environment tokens (off the loss mask) are skipped: a turn's last token bootstraps from the
  next turn's first."""
  mask = np.asarray(loss_mask, bool)
  rows, length = mask.shape
  order = np.argsort(~mask, axis=1, kind="stable")  # each row's loss tokens first, in their order
  count = mask.sum(axis=1)
  packed = np.arange(length)[None, :] < count[:, None]
  token_rewards = np.zeros((rows, length), np.float32)
  token_rewards[np.arange(rows), np.maximum(count - 1, 0)] = np.where(count > 0, np.asarray(rewards, np.float32), 0.0)
  packed_values = np.take_along_axis(np.asarray(values, np.float32), order, axis=1)
  advantages, returns = (np.zeros((rows, length), np.float32) for _ in range(2))
  for out, part in zip((advantages, returns), gae(token_rewards, packed_values, packed, gamma, lam)):
    np.put_along_axis(out, order, part, axis=1)
  return advantages, returns


def critic_update(tokens, valid, loss_mask, values, returns, *, model, owners=None):
  """Adds the shard's value loss to the critic's step (`workflow.critic.Critic`); it writes no field."""
  model.accumulate(tokens, valid, loss_mask, values, returns, owners)


# what generate writes (`completion_lengths`: each sample's loss tokens, known on every process of a trainer)
SAMPLE = ("tokens:ids", "valid:mask", "loss_mask:mask", "logprobs:token", "group_ids:group",
          "completion_lengths:sample")
OPS.register("generate")(Op(role="sampler", outputs=SAMPLE))
# the run's reward functions (RewardConfig), scored by the sampler
OPS.register("rule_reward")(Op(role="sampler", inputs=("tokens:ids",), outputs=("rewards:sample",)))
OPS.register("policy_update")(Op(role="trainer", inputs=SAMPLE[:4] + ("advantages:sample|token",)))
OPS.register("group_advantage")(Op(group_advantage))
OPS.register("kl_penalty")(Op(kl_penalty))
OPS.register("reverse_kl")(Op(reverse_kl))
OPS.register("reference_logprobs")(Op(model_scores, model="reference"))
OPS.register("teacher_logprobs")(Op(model_scores, model="teacher"))
OPS.register("judge_reward")(Op(model_scores, model="judge"))
OPS.register("critic_values")(Op(model_scores, model="critic"))
OPS.register("gae")(Op(token_gae))
OPS.register("critic_update")(Op(critic_update, model="critic"))


def role_pools() -> dict[str, str]:
  """op name -> the pool whose program it is."""
  return {name: OPS.get(name).role for name in OPS.names() if OPS.get(name).role}


def resolve_op(name: str) -> Op:
  """The built-in op `name`, or the user's function at the import path `name`."""
  return registered_or_loaded(OPS, name, lambda path: Op(load_function(path, "stage op")))


def registered_or_loaded(registry: Registry, name: str, load: Callable, key: str = ""):
  """`registry`'s item `name`, or what `load` finds at the user's import path `name` ('module:name', 'file.py:name');
  GraphError (after `key`) naming what is wrong otherwise."""
  if ":" not in name:
    try:
      return registry.get(name)
    except ValueError as err:
      raise GraphError(f"{key}{err} (or the user's 'module:name')") from None
  try:
    return load(name)
  except RewardFunctionError as err:
    raise GraphError(str(err)) from None
