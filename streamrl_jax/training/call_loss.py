"""One trainer call's loss on the device: the policy's log-probabilities of the batch's tokens (a mixture's routes
replayed or not), the per-token objective with its KL penalty and entropy bonus, the objective's extra terms, and
the sums a call adds to its step's (`SUMS`: what the step's metrics row divides)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from streamrl_jax.models import ModelConfig
from streamrl_jax.models.activation_layout import ActivationLayout
from streamrl_jax.models.moe import ExpertPlacement
from streamrl_jax.models.transformer import Routing
from streamrl_jax.training.config import TrainerConfig
from streamrl_jax.training.logprobs import Truncation, at_columns, chunked_scorer, every_column, logits_scorer
from streamrl_jax.training.corrections import HISTOGRAM_BINS, Sequences, histogram_quantile, ratio_histogram
from streamrl_jax.training.objectives import (TERMS, ObjectiveConfig, ValueLossConfig, clipped_value_loss, kl_penalty,
                                              policy_loss, with_old_logprobs)

SUMS = ("numerator", "denominator", "tokens", "clipped", "kl", "entropy", "mismatch_kl", "mismatch_max",
        # the corrections' counts: sequences, tokens and sequences rejected, tokens truncated; the mismatch of the
        # tokens sampled by the weights being trained (`stale` False: compute alone); the ratio's histogram
        "sequences", "masked", "masked_sequences", "truncated", "fresh_tokens", "fresh_mismatch_kl", "ratio_hist",
        "outside")  # with top-k / top-p: tokens below the support the trainer rebuilt
# a mixture of experts' too: its terms' part of the loss, and the token-layer routes the trainer chose as the sampler
# did, of those the sampler recorded
MOE_SUMS = ("terms", "agree", "routed")
MAXED = ("mismatch_max",)  # accumulated by maximum, the others by sum
# metrics a step may have nothing to measure with (NaN then): left out of its row
UNDEFINED_WHEN_EMPTY = ("logprob_mismatch_kl_compute", "logprob_mismatch_kl_staleness", "is_ratio_q05", "is_ratio_q50",
                        "is_ratio_q95")


def zero_sums(moe: bool = False) -> dict:
  shape = lambda k: (HISTOGRAM_BINS + 2,) if k == "ratio_hist" else ()  # noqa: E731
  return {k: jnp.zeros(shape(k), jnp.float32) for k in SUMS + (MOE_SUMS if moe else ())}


def logprob_mismatch(logp, logprobs, mask):
  """(sum, max) over the masked tokens of the sampler-vs-trainer gap: KL(mu || pi) per token by the k3
  estimator on the sampled tokens (pi/mu - 1 - log(pi/mu), >= 0, zero only where they agree), and the
  largest |log pi - log mu|."""
  delta = jnp.where(mask, logp - logprobs, 0.0)
  return jnp.sum(jnp.expm1(delta) - delta), jnp.max(jnp.abs(delta), initial=0.0)


def router_agreement(own: jax.Array, recorded: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(token-layer choices where the trainer's own top k [B, T, layers, k] is the set the sampler recorded, choices
  recorded): `recorded` holds expert + 1 (0: not recorded, as for a completion's last token), `valid` [B, T]."""
  seen = (recorded[..., 0] > 0) & valid[..., None]
  same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded.astype(own.dtype) - 1, axis=-1), axis=-1)
  return jnp.sum(same & seen, dtype=jnp.float32), jnp.sum(seen, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class CallLoss:
  """What a trainer call computes its loss with: the objective, the trainer's config (chunks, remat), a critic's value
  loss, the sampler's temperature, the role, where a mixture's experts live, the mixture's model config (None: a
  dense model), whether the LM head learns (LoRA: frozen), the sampler's top-k, top-p and min-p (`truncation`:
  tokens are scored over the support they keep) and the call's activation layout (its mesh, its attention kernel)."""

  objective: ObjectiveConfig
  config: TrainerConfig
  temperature: float = 1.0
  role: str = "policy"
  placement: ExpertPlacement | None = None
  moe: ModelConfig | None = None
  head_grad: bool = True
  truncation: Truncation = Truncation()
  # the trainer's mesh and attention kernel: rows kept on their batch shards, the head's chunks gathered
  layout: ActivationLayout | None = None
  value_loss: ValueLossConfig = ValueLossConfig()  # a critic's (`WorkflowConfig.value_loss`)

  def token_logprobs(self, model, batch, replay: bool = True):
    """(log pi, entropy, router trace, outside) of the batch's tokens under `model`: over vocabulary chunks, or from
    full logits, over the sampler's truncated support (`outside`: tokens that lie below the support rebuilt from these
    logits). A mixture's routes are replayed (`ObjectiveConfig.routing_replay`) where the batch carries them and
    `replay`; the trace is None without experts."""
    routes = batch.get("routes") if replay and self.objective.routing_replay == "replay" else None
    routing = Routing(routes=None if routes is None else routes.astype(jnp.int32) - 1, placement=self.placement)
    hidden, trace = model.hidden_and_routing(batch["tokens"], batch["valid"], batch.get("segment_ids"),
                                             remat=self.config.remat, routing=routing, layout=self.layout)
    if self.config.logprob_chunk:
      head, vocab_axis = model.output_weights()
      score = chunked_scorer(head, self.temperature, self.config.logprob_chunk, vocab_axis, head_grad=self.head_grad,
                             truncation=self.truncation, mesh=None if self.layout is None else self.layout.mesh)
    else:
      score = logits_scorer(model.head_logits, self.temperature, self.truncation)
    if "head_columns" in batch:  # the loss's tokens alone (`Trainer.prepare`)
      logp, ent, outside = at_columns(score, hidden, batch["tokens"], batch["head_columns"])
    else:
      logp, ent, outside = every_column(score, hidden, batch["tokens"])
    return logp, ent, trace, outside

  def per_token(self, model, reference, batch) -> dict:
    """Under `model`, with `reference` the frozen policy of a KL penalty (None: no penalty): the per-token `loss`,
    `logp` (log pi, or a critic's values), `kl`, `ent`, the router `trace`, the `mask` of the tokens the loss
    aggregates (completion tokens the corrections kept), the tokens whose weight was `truncated` and those `outside` the
    support the sampler's truncation keeps."""
    cfg = self.objective
    if self.role == "critic":
      values = model(batch["tokens"], batch["valid"], batch.get("segment_ids"))
      value_loss = self.value_loss
      loss = value_loss.coef * clipped_value_loss(values, batch["old_values"], batch["returns"], value_loss.clip)
      zeros = jnp.zeros_like(values)
      none = jnp.zeros(values.shape, bool)
      return dict(loss=loss, logp=values, kl=zeros, ent=zeros, trace=None, mask=batch["loss_mask"], truncated=none,
                  outside=none)
    logp, ent, trace, outside = self.token_logprobs(model, batch)
    batch = with_old_logprobs(batch, logp, cfg)
    per_token, fix = policy_loss(logp, batch, cfg, batch.get("segment_ids"))
    kl = jnp.zeros_like(logp)
    if reference is not None:  # the reference routes by its own router
      ref_logp = self.token_logprobs(reference, batch, replay=False)[0]
      kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp), cfg.kl_estimator)
      if not cfg.kl_in_reward:
        per_token = per_token + cfg.kl_coef * kl
    if cfg.entropy_coef:
      per_token = per_token - cfg.entropy_coef * ent
    return dict(loss=per_token, logp=logp, kl=kl, ent=ent, trace=trace, mask=batch["loss_mask"] & fix.keep,
                truncated=fix.truncated, outside=outside)

  def terms(self, trace, batch):
    """The objective's extra terms of this call (`ObjectiveConfig.terms`), summed: each over the call's tokens."""
    if not self.objective.terms:
      return jnp.zeros((), jnp.float32)
    tokens = jnp.sum(batch["valid"], dtype=jnp.float32)
    coef = self.moe.router_aux_loss_coef if self.moe is not None else 0.0
    return sum(TERMS.get(name)(trace, tokens, coef) for name in self.objective.terms)

  def call_sums(self, batch, outputs: dict) -> dict:
    """What one call adds to its step's sums, from its outputs (`per_token`'s, and the numerator, denominator and
    terms)."""
    mask, cfg = batch["loss_mask"], self.objective
    logp = outputs["logp"]
    m = mask.astype(jnp.float32)
    add = dict(numerator=outputs["numerator"], denominator=outputs["denominator"], tokens=m.sum(),
               kl=jnp.sum(outputs["kl"] * m), entropy=jnp.sum(outputs["ent"] * m))
    if self.role == "policy":
      ratio = jnp.exp(logp - with_old_logprobs(batch, logp, cfg)["old_logprobs"])
      add["clipped"] = jnp.sum(((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)) * m)
      add.update(off_policy_sums(jax.lax.stop_gradient(logp), batch, outputs))
    else:  # logp holds the values: count tokens whose value update is clipped
      add["clipped"] = jnp.sum((jnp.abs(logp - batch["old_values"]) > self.value_loss.clip) * m)
      add.update({k: jnp.zeros_like(v) for k, v in zero_sums().items() if k not in add})
    if self.moe is not None:
      trace = outputs["trace"]
      agree, routed = (router_agreement(trace.experts, batch["routes"], batch["valid"]) if "routes" in batch
                       else (jnp.zeros((), jnp.float32),) * 2)
      add.update(terms=outputs["terms"], agree=agree, routed=routed)
    return add


def off_policy_sums(logp, batch, outputs: dict) -> dict:
  """A policy call's sums of how far its tokens are from the sampler's policy: the mismatch (all tokens, and those
  the weights being trained sampled: `batch["stale"]` False), the corrections' rejected and truncated tokens and
  sequences, and the histogram of log(pi / mu)."""
  mask = batch["loss_mask"]
  seqs = Sequences.of(mask, batch.get("segment_ids"))
  fresh = mask & ~batch["stale"] if "stale" in batch else mask
  mismatch, mismatch_max = logprob_mismatch(logp, batch["logprobs"], mask)
  kept = seqs.sums(outputs["mask"].astype(jnp.float32))
  lengths = seqs.lengths()
  return dict(mismatch_kl=mismatch, mismatch_max=mismatch_max, fresh_mismatch_kl=logprob_mismatch(
      logp, batch["logprobs"], fresh)[0], fresh_tokens=jnp.sum(fresh, dtype=jnp.float32),
              sequences=seqs.count().astype(jnp.float32), masked=jnp.sum(mask & ~outputs["mask"], dtype=jnp.float32),
              masked_sequences=jnp.sum((lengths > 0) & (kept == 0), dtype=jnp.float32),
              truncated=jnp.sum(outputs["truncated"] & mask, dtype=jnp.float32),
              outside=jnp.sum(outputs["outside"] & mask, dtype=jnp.float32),
              ratio_hist=ratio_histogram(logp - batch["logprobs"], mask))


def off_policy_metrics(sums: dict) -> dict:
  """A policy step's off-policy figures from its sums: the shares of tokens and sequences the corrections masked
  (rejected) and of tokens they truncated, the quantiles of pi / mu, and the mismatch split into the part of the
  tokens sampled by the weights trained (`logprob_mismatch_kl_compute`: compute alone) and of older ones
  (`_staleness`: staleness on top of it); NaN where a part has no token (`UNDEFINED_WHEN_EMPTY`)."""
  tokens = jnp.maximum(sums["tokens"], 1.0)
  fresh, stale = sums["fresh_tokens"], sums["tokens"] - sums["fresh_tokens"]
  per = lambda total, n: total / jnp.where(n > 0, n, jnp.nan)  # noqa: E731
  return dict(correction_masked_token_frac=sums["masked"] / tokens,
              correction_masked_sequence_frac=sums["masked_sequences"] / jnp.maximum(sums["sequences"], 1.0),
              correction_truncated_token_frac=sums["truncated"] / tokens,
              support_mismatch_frac=sums["outside"] / tokens,
              is_ratio_q05=histogram_quantile(sums["ratio_hist"], 0.05),
              is_ratio_q50=histogram_quantile(sums["ratio_hist"], 0.5),
              is_ratio_q95=histogram_quantile(sums["ratio_hist"], 0.95),
              logprob_mismatch_kl_compute=per(sums["fresh_mismatch_kl"], fresh),
              logprob_mismatch_kl_staleness=per(sums["mismatch_kl"] - sums["fresh_mismatch_kl"], stale))


def step_metrics(sums: dict, denominator, moe: bool) -> dict:
  """The metrics of a mixture's step beyond every policy's: its terms' part of the loss, and `router_agreement`
  (NaN where no route was recorded)."""
  if not moe:
    return {}
  routed = sums["routed"]
  return dict(objective_terms=sums["terms"] / denominator,
              router_agreement=sums["agree"] / jnp.where(routed > 0, routed, jnp.nan))
