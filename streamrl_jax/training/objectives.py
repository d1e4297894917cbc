"""Policy objectives, KL estimators and value losses: pure per-token functions.

Every per-token function returns a loss [B, T] to minimise; `aggregate` turns it into the
(numerator, denominator) pair whose ratio is the batch loss. Numerators and denominators add up over
micro-batches, which makes streamed gradient accumulation exact for every aggregation mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from streamrl_jax.models.moe import RouterTrace, load_balancing_loss
from streamrl_jax.registry import Registry

OBJECTIVES = Registry("policy objective")
TERMS = Registry("objective term")  # losses added to the policy loss, of what a call's forward reports
ROUTING_REPLAY = ("off", "replay")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
UNCORRECTED = ("ppo_recomputed", "reinforce")  # objectives in which the sampler's log-probabilities play no part
sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Hyper-parameters of the policy loss."""

  # the per-token policy loss: ppo, ppo_tis, ppo_recomputed, decoupled_ppo, aipo or reinforce (OBJECTIVES)
  objective: str = "ppo"
  # how token losses become the batch loss: token_mean, seq_mean_token_sum, seq_mean_token_mean or constant
  aggregation: str = "token_mean"
  clip_low: float = 0.2  # ratio floor 1 - clip_low
  clip_high: float = 0.2  # ratio ceiling 1 + clip_high (DAPO clip-higher: 0.28)
  constant_normalizer: float = 1024.0  # tokens per sequence for aggregation="constant" (Dr. GRPO)
  tis_cap: float = 2.0  # ppo_tis: behaviour weights are clamped at this value
  behaviour_cap: float = 5.0  # decoupled_ppo: tokens whose behaviour ratio exceeds this are dropped
  aipo_rho: float = 4.0  # aipo: ratio truncation, 2 to 10 in LlamaRL
  kl_coef: float = 0.0  # weight of the KL penalty to the frozen initial policy (0: no penalty, no reference)
  kl_estimator: str = "k3"  # per-token KL estimator: "k1", "k2" or "k3" (Schulman)
  kl_in_reward: bool = False  # True: the KL penalty goes into the reward instead of the loss
  entropy_coef: float = 0.0  # weight of the entropy bonus subtracted from the loss (0: none)
  # a mixture of experts: "replay" routes each token through the experts the sampler chose (R3), "off" the trainer's
  # own top k
  routing_replay: str = "off"
  # extra loss terms by name (TERMS): "load_balancing" (a mixture's router loss, weighted by the checkpoint's
  # router_aux_loss_coef)
  terms: tuple = ()

  def __post_init__(self):
    OBJECTIVES.get(self.objective)
    if self.routing_replay not in ROUTING_REPLAY:
      raise ValueError(f"ObjectiveConfig.routing_replay={self.routing_replay!r}; known: {list(ROUTING_REPLAY)}")
    for term in self.terms:
      TERMS.get(term)
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"unknown aggregation {self.aggregation!r}; known: {list(AGGREGATIONS)}")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; known: {list(KL_ESTIMATORS)}")
    for name in ("clip_low", "clip_high", "constant_normalizer"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ObjectiveConfig.{name} must be > 0, got {getattr(self, name)}")
    if self.clip_low >= 1:
      raise ValueError(f"ObjectiveConfig.clip_low must be < 1 (the ratio floor is 1 - clip_low), got {self.clip_low}")
    for name in ("aipo_rho", "tis_cap", "behaviour_cap"):
      if getattr(self, name) < 1:
        raise ValueError(f"ObjectiveConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
  """The critic trainer's clipped value loss."""

  coef: float = 0.5  # weight of the clipped value loss
  clip: float = 0.2  # PPO clip range of the values around the old values

  def __post_init__(self):
    if self.clip <= 0 or self.coef < 0:
      raise ValueError(f"ValueLossConfig out of range: {self}")


@TERMS.register("load_balancing")
def load_balancing(trace: RouterTrace | None, tokens, coef: float):
  """A mixture's router loss (`models.moe.load_balancing_loss`) over the call's tokens, times `coef`."""
  if trace is None:
    raise ValueError("ObjectiveConfig.terms names 'load_balancing', but the model has no mixture-of-experts layers")
  return coef * load_balancing_loss(trace.load, trace.importance, tokens)


def uses_old_logprobs(fn):
  """Marks an objective that compares with the trainer's own policy before the step (`old_logprobs`)."""
  fn.uses_old_logprobs = True
  return fn


def with_old_logprobs(batch: dict, logp, objective: str) -> dict:
  """`batch` with `old_logprobs`: as given; else, for an objective that uses them, the trainer's policy
  before this step's update, which is `logp` without gradient (every micro-batch of a step is accumulated at
  the same parameters and the update comes once, at the end: exact, and no second forward); else the
  sampler's (what the clipped-ratio figure compares with)."""
  if "old_logprobs" in batch:
    return batch
  own = getattr(OBJECTIVES.get(objective), "uses_old_logprobs", False)
  return {**batch, "old_logprobs": sg(logp) if own else batch["logprobs"]}


def _clipped_surrogate(logp, reference_logp, advantages, cfg: ObjectiveConfig):
  ratio = jnp.exp(logp - reference_logp)
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  return -jnp.minimum(ratio * advantages, clipped * advantages)


@OBJECTIVES.register("ppo")
def ppo(logp, batch, cfg: ObjectiveConfig):
  """Clipped surrogate with ratio pi / pi_old, pi_old the behaviour (sampler) log-probabilities."""
  return _clipped_surrogate(logp, batch["logprobs"], batch["advantages"], cfg)


@OBJECTIVES.register("ppo_tis")
@uses_old_logprobs
def ppo_tis(logp, batch, cfg: ObjectiveConfig):
  """PPO against the trainer's recomputed old log-probabilities, times the truncated importance
  weight min(pi_old / mu, tis_cap) of the sampler's policy mu (no gradient through the weight)."""
  weight = sg(jnp.minimum(jnp.exp(batch["old_logprobs"] - batch["logprobs"]), cfg.tis_cap))
  return weight * _clipped_surrogate(logp, batch["old_logprobs"], batch["advantages"], cfg)


@OBJECTIVES.register("ppo_recomputed")
@uses_old_logprobs
def ppo_recomputed(logp, batch, cfg: ObjectiveConfig):
  """PPO against the trainer's recomputed old log-probabilities alone: the sampler's mu plays no part, so a
  sampler that computes differently (lower precision) biases the gradient uncorrected. The baseline that
  `ppo_tis` corrects."""
  return _clipped_surrogate(logp, batch["old_logprobs"], batch["advantages"], cfg)


@OBJECTIVES.register("decoupled_ppo")
@uses_old_logprobs
def decoupled_ppo(logp, batch, cfg: ObjectiveConfig):
  """Decoupled PPO: clip around the proximal policy (the trainer's policy before the step, given as
  old_logprobs), weighted by the behaviour ratio pi_prox / mu; tokens whose behaviour ratio exceeds
  behaviour_cap are left out of the loss (truncation by masking)."""
  behaviour = sg(jnp.exp(batch["old_logprobs"] - batch["logprobs"]))
  weight = jnp.where(behaviour <= cfg.behaviour_cap, behaviour, 0.0)
  return weight * _clipped_surrogate(logp, batch["old_logprobs"], batch["advantages"], cfg)


@OBJECTIVES.register("aipo")
def aipo(logp, batch, cfg: ObjectiveConfig):
  """LlamaRL's AIPO: -stop_gradient(min(pi / mu, rho)) * A * log pi. The truncated ratio only
  weights the gradient; it is never clamped inside the differentiated term."""
  weight = sg(jnp.minimum(jnp.exp(logp - batch["logprobs"]), cfg.aipo_rho))
  return -weight * batch["advantages"] * logp


@OBJECTIVES.register("reinforce")
def reinforce(logp, batch, cfg: ObjectiveConfig):
  """On-policy policy gradient: -A * log pi."""
  return -batch["advantages"] * logp


def kl_penalty(logp, ref_logp, estimator: str):
  """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
  log_ratio = logp - ref_logp
  if estimator == "k1":
    return log_ratio
  if estimator == "k2":
    return 0.5 * log_ratio**2
  if estimator == "k3":
    return jnp.exp(-log_ratio) + log_ratio - 1.0
  raise ValueError(f"unknown KL estimator {estimator!r}; known: {list(KL_ESTIMATORS)}")


def clipped_value_loss(values, old_values, returns, clip: float):
  """PPO value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."""
  clipped = old_values + jnp.clip(values - old_values, -clip, clip)
  return 0.5 * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def aggregate(per_token, mask, cfg: ObjectiveConfig, segment_ids=None):
  """(numerator, denominator) of the batch loss; mask [B, T] marks completion tokens. A row is one sequence,
  or with `segment_ids` [B, T] (packed rows) each nonzero id of a row is one."""
  mask = mask.astype(jnp.float32)
  rows, width = mask.shape
  segments = jnp.ones(mask.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  ids = (jnp.arange(rows, dtype=jnp.int32)[:, None] * (width + 1) + segments).reshape(-1)
  lengths = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=rows * (width + 1))
  sequences = jnp.sum(lengths > 0)
  if cfg.aggregation == "token_mean":
    return jnp.sum(per_token * mask), lengths.sum()
  if cfg.aggregation == "seq_mean_token_sum":
    return jnp.sum(per_token * mask), sequences
  if cfg.aggregation == "seq_mean_token_mean":
    own_length = jnp.maximum(lengths[ids], 1.0).reshape(rows, width)
    return jnp.sum(per_token * mask / own_length), sequences
  return jnp.sum(per_token * mask), sequences * cfg.constant_normalizer


def kl_penalized_rewards(rewards, logp, ref_logp, mask, coef: float, estimator: str = "k1"):
  """Sequence rewards minus coef * the summed per-token KL (the 'KL in the reward' variant)."""
  return rewards - coef * jnp.sum(kl_penalty(logp, ref_logp, estimator) * mask, axis=-1)
