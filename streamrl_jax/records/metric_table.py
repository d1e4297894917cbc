"""Every key a run's metrics row may hold, with its type, the part that writes it and its meaning: the one table
docs/metrics.md shows (generated: `python -m streamrl_jax.records.metric_table`), and the check each row passes
(`check_row`: a key not listed is logged; with STREAMRL_STRICT_METRICS=1, as the tests run, it is an error)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

_log = logging.getLogger(__name__)
STRICT_ENV = "STREAMRL_STRICT_METRICS"


@dataclasses.dataclass(frozen=True)
class Metric:
  """One row key: `name` (a `<part>` in it stands for any name, e.g. a reward function's), its type, the part that
  writes it (`owner`) and what it means."""

  name: str
  kind: str
  owner: str
  meaning: str

  @property
  def prefix(self) -> str | None:
    """The fixed part before a `<...>` placeholder, or None for a plain name."""
    return self.name.split("<")[0] if "<" in self.name else None


# the parts that write a row: each hands its keys in as one part of `join_row`, and a key belongs to one of them
STEP, UPDATE, SAMPLERS = "step row", "update", "samplers"  # the trainer's step; its update; the samplers' summary
PROCESS, EVALUATION, ARMS = "trainer process", "evaluation", "arms"  # memory and queue; held-out accuracy; an arm's
CORRECTIONS = UPDATE  # the off-policy corrections' figures are the update's
METRICS = (
    Metric("step", "int", STEP, "the RL step (1-based); the weights after it are version `step`"),
    Metric("time", "float", STEP, "Unix time the row was made"),
    Metric("reward_mean", "float", STEP, "mean reward of every sample that arrived for the step (filtered groups too)"),
    Metric("reward/<function>", "float", STEP, "mean score of one reward function (`task`: the task's own verifier)"),
    Metric("reward_errors", "int", STEP, "reward calls that raised or returned no number (scored 0)"),
    Metric("reward_timeouts", "int", STEP, "reward calls past their limit (scored 0)"),
    Metric("accuracy", "float", STEP, "share of the step's arrived samples with reward >= 1"),
    Metric("samples_per_s", "float", STEP, "samples that arrived per second of the step's wall time"),
    Metric("staleness_mean", "float", STEP, "versions the sampling weights lagged, per trained token"),
    Metric("staleness_max", "int", STEP, "the most versions a trained token's weights lagged"),
    Metric("groups_filtered", "int", STEP, "dynamic sampling: equal-reward groups not trained"),
    Metric("groups_backfilled", "int", STEP, "dynamic sampling: prompts leased in their place"),
    Metric("prompts_leased", "int", STEP, "prompts leased for the step (planned and backfilled)"),
    Metric("equal_reward_groups_trained", "int", STEP, "trained groups whose rewards are all equal (no signal)"),
    Metric("env_tokens", "int", STEP, "trained tokens an environment wrote (masked out of the loss)"),
    Metric("trainer_idle_frac", "float", STEP, "share of the step the trainer waited for samples"),
    Metric("sampler_idle_frac", "float", STEP, "the samplers' idle share of the run so far"),
    Metric("weight_sync_s", "float", STEP, "seconds the last version's weights took to send"),
    Metric("step_s", "float", STEP, "wall seconds from the previous step's end to this one's"),
    Metric("train_s", "float", STEP, "seconds of the step's accumulation and update"),
    Metric("train_calls", "int", STEP, "the trainer's calls (micro-batches) this step"),
    Metric("train_tokens", "int", STEP, "real tokens (prompt and completion) the trainer's calls held"),
    Metric("train_padding_frac", "float", STEP, "share of the calls' tokens that were padding"),
    Metric("trainer_s/<phase>", "float", STEP, "the training thread's seconds in a phase since the previous row"),
    Metric("trainer_accounted_frac", "float", STEP, "share of the training thread's seconds in a named phase"),
    Metric("update_skipped", "float", STEP, "1 when the step had no update (no token to train)"),
    Metric("empty_step", "float", STEP, "1 when every completion was empty or every episode failed"),
    Metric("stage/<field>", "float", STEP, "mean of a float field a trainer stage of the step graph wrote, over the "
           "samples (a token field: over the loss tokens); `distill`'s stage/advantages is minus the reverse KL to the "
           "teacher per token"),
    Metric("loss", "float", UPDATE, "the objective's value, per its aggregation"),
    Metric("critic/<metric>", "float", UPDATE, "the `ppo` graph's critic's update: its clipped value `loss`, "
           "`grad_norm` and `clip_frac` (share of loss tokens whose value moved past the clip)"),
    Metric("grad_norm", "float", UPDATE, "global gradient norm before clipping"),
    Metric("learning_rate", "float", UPDATE, "the learning rate of the update"),
    Metric("tokens", "float", UPDATE, "loss tokens (completion tokens the policy wrote) the update trained"),
    Metric("clip_frac", "float", UPDATE, "share of loss tokens whose ratio was clipped"),
    Metric("optimizer_updates", "float", UPDATE, "optimizer updates the step made (TrainerConfig.mini_batches x "
           "epochs; fewer where a mini-batch held no loss token); the update's other keys are their mean"),
    Metric("clip_frac_first", "float", UPDATE, "clip_frac of the step's first update (0 on policy: its ratio is 1)"),
    Metric("clip_frac_last", "float", UPDATE, "clip_frac of the step's last update"),
    Metric("kl", "float", UPDATE, "per-token KL to the reference (0 without one)"),
    Metric("entropy", "float", UPDATE, "per-token entropy of the policy"),
    Metric("logprob_mismatch_kl", "float", UPDATE, "per-token KL between the sampler's and the trainer's "
           "log-probabilities of the sampled tokens"),
    Metric("logprob_mismatch_max", "float", UPDATE, "the largest |sampler - trainer| log-probability of a token"),
    Metric("objective_terms", "float", UPDATE, "mixture of experts: the objective's extra terms' part of the loss"),
    Metric("router_agreement", "float", UPDATE, "mixture of experts: share of routes the trainer chose as the "
           "sampler did (NaN when none was recorded)"),
    Metric("correction_masked_token_frac", "float", CORRECTIONS, "share of tokens the corrections masked"),
    Metric("correction_masked_sequence_frac", "float", CORRECTIONS, "share of sequences the corrections masked"),
    Metric("correction_truncated_token_frac", "float", CORRECTIONS, "share of tokens whose weight was truncated"),
    Metric("support_mismatch_frac", "float", CORRECTIONS, "share of tokens drawn outside the trainer's rebuilt "
           "top-k/top-p support"),
    Metric("is_ratio_q05", "float", CORRECTIONS, "5% quantile of pi / mu over the step's tokens"),
    Metric("is_ratio_q50", "float", CORRECTIONS, "median of pi / mu"),
    Metric("is_ratio_q95", "float", CORRECTIONS, "95% quantile of pi / mu"),
    Metric("logprob_mismatch_kl_compute", "float", CORRECTIONS, "the mismatch KL of tokens the trained weights "
           "sampled (NaN when none)"),
    Metric("logprob_mismatch_kl_staleness", "float", CORRECTIONS, "the mismatch KL of tokens older weights sampled "
           "(NaN when none)"),
    Metric("generation_s", "float", SAMPLERS, "seconds the step's generation took, its slowest sampler's"),
    Metric("sampler_instances", "int", SAMPLERS, "sampler engines that worked on the step"),
    Metric("sampler_processes", "int", SAMPLERS, "sampler processes that worked on the step"),
    Metric("sampler_rss_mb", "float", SAMPLERS, "the largest sampler process's resident memory"),
    Metric("template_prefix_mismatch", "int", SAMPLERS, "agent turns whose chat template did not extend the "
           "previous turn's tokens"),
    Metric("sampler_s/<phase>", "float", SAMPLERS, "the samplers' seconds in a phase, added up"),
    Metric("sampler_accounted_frac", "float", SAMPLERS, "share of the samplers' seconds in a named phase"),
    Metric("ranker_<figure>", "float", SAMPLERS, "with a length ranker: `recall_top20`, `recall_top10`, `recall_top5` "
           "(share of the longest 20/10/5% it put in its top 20/10/5%), `spearman` (rank correlation of predicted "
           "and realised lengths), `train_steps` (its online training steps so far)"),
    Metric("rss_mb", "float", PROCESS, "the trainer process's resident memory"),
    Metric("queue_depth", "int", PROCESS, "samples in the trainer's queue at the row"),
    Metric("queue_max_depth", "int", PROCESS, "the most samples the queue held so far"),
    Metric("heldout_accuracy", "float", EVALUATION, "held-out accuracy (`JobConfig.eval_every`)"),
    Metric("heldout_avg@<k>", "float", EVALUATION, "mean share correct of k samples a held-out prompt "
                                                    "(`JobConfig.eval_k`, at `eval_temperature` and `eval_top_p`)"),
    Metric("heldout_pass@<k>", "float", EVALUATION, "chance that k samples of a held-out prompt hold a correct one "
                                                     "(the unbiased estimator of Chen et al. 2021)"),
    Metric("arm", "str", ARMS, "the follower arm whose row it is"),
    Metric("arm_policy_divergence", "float", ARMS, "the arm's KL to the sampling policy (its "
           "`logprob_mismatch_kl`)"),
    Metric("arm_lag", "int", ARMS, "steps the arm is behind the lead"),
    Metric("arm_steps_skipped", "int", ARMS, "steps the arm did not train so far"),
    Metric("arm_samples_skipped", "int", ARMS, "samples the arm did not train so far"),
)
_NAMES = frozenset(m.name for m in METRICS if m.prefix is None)
_PREFIXES = tuple(m.prefix for m in METRICS if m.prefix is not None)
_OWNERS = {m.name: m.owner for m in METRICS if m.prefix is None}


def unlisted(row: dict) -> list[str]:
  """The keys of `row` the table does not list."""
  return [k for k in row if k not in _NAMES and not k.startswith(_PREFIXES)]


def check_row(row: dict) -> dict:
  """`row`, after checking its keys: one not listed is logged once (an error under STREAMRL_STRICT_METRICS=1)."""
  if missing := unlisted(row):
    _refuse(f"metrics row keys {missing} are not in streamrl_jax/records/metric_table.py (docs/metrics.md)")
  return row


def owner_of(key: str) -> str | None:
  """The part that writes `key` (None: not listed)."""
  return _OWNERS.get(key) or next((m.owner for m in METRICS if m.prefix and key.startswith(m.prefix)), None)


def join_row(parts: dict[str, dict], row: dict | None = None) -> dict:
  """A new row: `row`'s keys (default none) and each part's, `parts` by the part that writes them ({STEP: {...},
  UPDATE: {...}}). A key the table gives to another part, one already in the row, or one not listed is logged once
  (an error under STREAMRL_STRICT_METRICS=1): no part writes another's key, and none edits a row in place."""
  out = dict(row or {})
  for part, values in parts.items():
    for key, value in values.items():
      owner = owner_of(key)
      if owner is None:
        _refuse(f"metrics row key {key!r} (from the {part}) is not in streamrl_jax/records/metric_table.py "
                "(docs/metrics.md)")
      elif owner != part:
        _refuse(f"metrics row key {key!r} is the {owner}'s (records/metric_table.py), but the {part} wrote it")
      if key in out:
        _refuse(f"metrics row key {key!r} was written twice (the second time by the {part})")
      out[key] = value
  return out


def _refuse(problem: str) -> None:
  if os.environ.get(STRICT_ENV) == "1":
    raise ValueError(problem)
  _warn_once(problem)


@functools.cache
def _warn_once(problem: str) -> None:
  _log.warning(problem)


def markdown() -> str:
  """The table as docs/metrics.md holds it."""
  lines = ["| key | type | written by | meaning |", "|---|---|---|---|"]
  lines += [f"| `{m.name}` | {m.kind} | {m.owner} | {m.meaning} |" for m in METRICS]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  print(markdown(), end="")
