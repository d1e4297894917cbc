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
from streamrl_jax.training.corrections import CORRECTIONS, CorrectionConfig, Sequences, correct

OBJECTIVES = Registry("policy objective")
TERMS = Registry("objective term")  # losses added to the policy loss, of what a call's forward reports
ROUTING_REPLAY = ("off", "replay")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
OLD_LOGPROBS = ("recompute", "sampler")
# objectives of earlier versions: what each is now
RENAMED = {"ppo_tis": "objective='ppo', correction='token_tis'",
           "ppo_recomputed": "objective='ppo', correction='none'",
           "decoupled_ppo": "objective='ppo', correction=('token_tis', 'token_mask'), CorrectionConfig.tis_cap = "
                            "mask_high = the old behaviour_cap, mask_low=0"}
sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Hyper-parameters of the policy loss: the surrogate, the old policy it compares with, and the off-policy
  correction of tokens another policy sampled (`training.corrections`)."""

  # the per-token surrogate: ppo (clipped ratio), gspo (clipped sequence ratio), cispo (clipped IS weight), aipo or
  # reinforce (OBJECTIVES)
  objective: str = "ppo"
  # the old policy of the surrogate's ratio: "recompute" (the trainer's own before this step's update: free here, the
  # step's calls all run at those weights) or "sampler" (bypass: the sampler's log-probabilities; the surrogate's
  # clip is then the only correction, so `correction` must be 'none')
  old_logprobs: str = "recompute"
  # off-policy corrections by name, composed (CORRECTIONS): token_tis, sequence_tis, geometric_tis, token_mask,
  # sequence_mask, geometric_mask, icepop, veto; 'none' or () for none
  correction: tuple[str, ...] | str = ("token_tis",)
  # how token losses become the batch loss: token_mean, seq_mean_token_sum, seq_mean_token_mean or constant
  aggregation: str = "token_mean"
  clip_low: float = 0.2  # ratio floor 1 - clip_low (gspo: 3e-4 in its paper; cispo: the IS weight's floor)
  clip_high: float = 0.2  # ratio ceiling 1 + clip_high (DAPO clip-higher: 0.28; gspo: 4e-4)
  constant_normalizer: float = 1024.0  # tokens per sequence for aggregation="constant" (Dr. GRPO)
  bands: CorrectionConfig = CorrectionConfig()  # the corrections' caps, bands and floors
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
    if self.objective in RENAMED:
      raise ValueError(f"ObjectiveConfig.objective={self.objective!r} is now {RENAMED[self.objective]}")
    OBJECTIVES.get(self.objective)
    parts = () if self.correction in ("none", (), ("none",)) else (
        (self.correction,) if isinstance(self.correction, str) else tuple(self.correction))
    object.__setattr__(self, "correction", parts)
    for part in parts:
      try:
        CORRECTIONS.get(part)
      except ValueError as e:
        raise ValueError(f"ObjectiveConfig.correction: {e}") from None
    if self.old_logprobs not in OLD_LOGPROBS:
      raise ValueError(f"ObjectiveConfig.old_logprobs={self.old_logprobs!r}; known: {list(OLD_LOGPROBS)}")
    if self.old_logprobs == "sampler" and parts:
      raise ValueError(f"ObjectiveConfig.old_logprobs='sampler' (bypass) compares with the sampler's policy itself: "
                       f"the correction {list(parts)} would weigh every token by 1; set ObjectiveConfig.correction="
                       f"'none', or old_logprobs='recompute'")
    if self.routing_replay not in ROUTING_REPLAY:
      raise ValueError(f"ObjectiveConfig.routing_replay={self.routing_replay!r}; known: {list(ROUTING_REPLAY)}")
    for term in self.terms:
      TERMS.get(term)
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"unknown aggregation {self.aggregation!r}; known: {list(AGGREGATIONS)}")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; known: {list(KL_ESTIMATORS)}")
    self._check_numbers()

  def _check_numbers(self) -> None:
    for name in ("clip_low", "clip_high", "constant_normalizer"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ObjectiveConfig.{name} must be > 0, got {getattr(self, name)}")
    if self.clip_low >= 1:
      raise ValueError(f"ObjectiveConfig.clip_low must be < 1 (the ratio floor is 1 - clip_low), got {self.clip_low}")
    if self.aipo_rho < 1:
      raise ValueError(f"ObjectiveConfig.aipo_rho must be >= 1, got {self.aipo_rho}")

  @property
  def corrected(self) -> bool:
    """Whether tokens of another policy are weighed by it: a correction, or a surrogate whose ratio is to the
    sampler's policy itself (bypass)."""
    return bool(self.correction) or (self.old_logprobs == "sampler" and self.objective != "reinforce")


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


def with_old_logprobs(batch: dict, logp, cfg: ObjectiveConfig) -> dict:
  """`batch` with `old_logprobs`: as given; else with `old_logprobs='recompute'` the trainer's policy before this
  step's update, which is `logp` without gradient (every micro-batch of a step is accumulated at the same
  parameters and the update comes once, at the end: exact, and no second forward); else (bypass) the sampler's."""
  if "old_logprobs" in batch:
    return batch
  return {**batch, "old_logprobs": sg(logp) if cfg.old_logprobs == "recompute" else batch["logprobs"]}


def _clipped_surrogate(ratio, advantages, cfg: ObjectiveConfig):
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  return -jnp.minimum(ratio * advantages, clipped * advantages)


@OBJECTIVES.register("ppo")
def ppo(logp, batch, cfg: ObjectiveConfig, seqs: Sequences):
  """Clipped surrogate -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A), rho = pi / pi_old per token."""
  return _clipped_surrogate(jnp.exp(logp - batch["old_logprobs"]), batch["advantages"], cfg)


@OBJECTIVES.register("gspo")
def gspo(logp, batch, cfg: ObjectiveConfig, seqs: Sequences):
  """GSPO: the clipped surrogate of the sequence ratio s = exp(mean_t log(pi / pi_old)), in its token form
  s_t = sg(s) * pi_t / sg(pi_t) (the value s on every token, the gradient s * grad log pi_t): with
  aggregation='seq_mean_token_mean' it is GSPO's sequence objective."""
  log_s = seqs.mean(logp - batch["old_logprobs"])
  ratio = sg(jnp.exp(log_s)) * jnp.exp(logp - sg(logp))
  return _clipped_surrogate(ratio, batch["advantages"], cfg)


@OBJECTIVES.register("cispo")
def cispo(logp, batch, cfg: ObjectiveConfig, seqs: Sequences):
  """CISPO: -sg(clip(rho, 1 - clip_low, 1 + clip_high)) A log pi: the IS weight is clipped, never the update (a
  token whose ratio leaves the band still has its gradient)."""
  weight = sg(jnp.clip(jnp.exp(logp - batch["old_logprobs"]), 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
  return -weight * batch["advantages"] * logp


@OBJECTIVES.register("aipo")
def aipo(logp, batch, cfg: ObjectiveConfig, seqs: Sequences):
  """LlamaRL's AIPO: -sg(min(pi / pi_old, rho)) A log pi, pi_old the sampler's in bypass (LlamaRL's form). The
  truncated ratio only weights the gradient; it is never clamped inside the differentiated term."""
  weight = sg(jnp.minimum(jnp.exp(logp - batch["old_logprobs"]), cfg.aipo_rho))
  return -weight * batch["advantages"] * logp


@OBJECTIVES.register("reinforce")
def reinforce(logp, batch, cfg: ObjectiveConfig, seqs: Sequences):
  """Policy gradient: -A log pi."""
  return -batch["advantages"] * logp


def policy_loss(logp, batch, cfg: ObjectiveConfig, segment_ids=None) -> tuple:
  """(per-token loss [B, T], the correction): the surrogate times the correction's weight, 0 on rejected tokens.
  `batch` holds old_logprobs (`with_old_logprobs`), the sampler's logprobs, advantages and loss_mask."""
  seqs = Sequences.of(batch["loss_mask"], segment_ids)
  surrogate = OBJECTIVES.get(cfg.objective)(logp, batch, cfg, seqs)
  fix = correct(batch["old_logprobs"] - batch["logprobs"], seqs, cfg.correction, cfg.bands)
  return fix.weight * surrogate, fix


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
  seqs = Sequences.of(mask, segment_ids)
  mask = seqs.mask
  if cfg.aggregation == "token_mean":
    return jnp.sum(per_token * mask), jnp.sum(mask)
  if cfg.aggregation == "seq_mean_token_sum":
    return jnp.sum(per_token * mask), seqs.count()
  if cfg.aggregation == "seq_mean_token_mean":
    own_length = jnp.maximum(seqs.spread(seqs.lengths()), 1.0)
    return jnp.sum(per_token * mask / own_length), seqs.count()
  return jnp.sum(per_token * mask), seqs.count() * cfg.constant_normalizer


def kl_penalized_rewards(rewards, logp, ref_logp, mask, coef: float, estimator: str = "k1"):
  """Sequence rewards minus coef * the summed per-token KL (the 'KL in the reward' variant)."""
  return rewards - coef * jnp.sum(kl_penalty(logp, ref_logp, estimator) * mask, axis=-1)
