"""TRL's GRPOConfig names (and a few of vLLM's and verl's) and what each is here: the source of the config's
"did you mean" hints and of docs/configuration.md's table."""

from __future__ import annotations

from typing import NamedTuple


class TrlName(NamedTuple):
  """What another framework's name is here: the gin key that sets it (None: no key), how it differs or why none,
  and whose name it is."""
  key: str | None
  note: str = ""
  source: str = "TRL's"


TRL_NAMES = {
    "num_generations": TrlName("PipelineConfig.group_size", "samples per prompt"),
    "learning_rate": TrlName("OptimizerConfig.learning_rate"),
    "beta": TrlName("ObjectiveConfig.kl_coef", "the KL penalty's weight; ObjectiveConfig.kl_estimator picks k1/k2/k3"),
    "max_completion_length": TrlName("PipelineConfig.max_new_tokens"),
    "max_prompt_length": TrlName("EngineConfig.max_prompt_length", "a longer prompt is refused, not cut"),
    "per_device_train_batch_size": TrlName(
        "PipelineConfig.prompts_per_step", "a step trains on prompts_per_step x group_size samples; the size of one "
        "call (micro-batch) is TrainerConfig.chunk_tokens (packed) or TrainerConfig.chunk_rows"),
    "generation_batch_size": TrlName("PipelineConfig.prompts_per_step", "samples per step: prompts_per_step x "
                                     "group_size"),
    "gradient_accumulation_steps": TrlName(
        "TrainerConfig.chunk_tokens", "a step always accumulates over all its calls and updates once; this sets the "
        "tokens per call"),
    "steps_per_generation": TrlName("TrainerConfig.mini_batches", "updates per generated batch, each on a share of "
                                    "its groups; async reuse of older samples is PipelineConfig.staleness"),
    "num_iterations": TrlName("TrainerConfig.epochs", "passes over a step's samples (mu of the GRPO paper); the ratio "
                              "is to the weights at the step's start"),
    "max_steps": TrlName("PipelineConfig.steps", "RL steps (optimizer updates)"),
    "num_train_epochs": TrlName("PipelineConfig.steps", "prompts are drawn per step, so a run is counted in steps"),
    "temperature": TrlName("PipelineConfig.temperature"),
    "top_p": TrlName("SamplerConfig.top_p", "the trainer scores over the same truncated support"),
    "top_k": TrlName("SamplerConfig.top_k", "0: off"),
    "min_p": TrlName("SamplerConfig.min_p"),
    "repetition_penalty": TrlName(None, "not built"),
    "epsilon": TrlName("ObjectiveConfig.clip_low", "and ObjectiveConfig.clip_high (TRL's epsilon sets both)"),
    "epsilon_high": TrlName("ObjectiveConfig.clip_high"),
    "delta": TrlName(None, "two-sided clipping is not built; the closest is ObjectiveConfig.objective='aipo' with "
                     "ObjectiveConfig.aipo_rho"),
    "loss_type": TrlName("ObjectiveConfig.aggregation", "grpo: 'seq_mean_token_mean'; bnpo or dapo: 'token_mean'; "
                         "dr_grpo: 'constant' with WorkflowConfig.advantage='dr_grpo'"),
    "scale_rewards": TrlName("WorkflowConfig.advantage", "'grpo' scales by the group's std, 'dr_grpo' does not"),
    "importance_sampling_level": TrlName("ObjectiveConfig.objective", "'sequence' is objective='gspo'"),
    "vllm_importance_sampling_correction": TrlName("ObjectiveConfig.correction", "on by default ('token_tis')"),
    "vllm_importance_sampling_cap": TrlName("CorrectionConfig.tis_cap"),
    "mask_truncated_completions": TrlName(None, "not built: a truncated completion is scored by its rewards"),
    "reward_funcs": TrlName("RewardConfig.functions", "'package.module:function' or 'file.py:function'"),
    "reward_weights": TrlName("RewardConfig.weights"),
    "use_vllm": TrlName(None, "the sampler is this project's own engine on its own devices "
                        "(MeshConfig.sampler_devices)"),
    "vllm_mode": TrlName("PipelineConfig.mode", "'colocated' shares the devices; 'async' and 'stream' give the "
                         "sampler its own"),
    "vllm_gpu_memory_utilization": TrlName("EngineConfig.memory_budget_bytes", "bytes per device, not a fraction"),
    "lr_scheduler_type": TrlName("OptimizerConfig.schedule", "'constant', 'cosine' or 'linear'"),
    "warmup_steps": TrlName("OptimizerConfig.warmup_steps"),
    "warmup_ratio": TrlName("OptimizerConfig.warmup_steps", "in steps, not a ratio"),
    "weight_decay": TrlName("OptimizerConfig.weight_decay"),
    "adam_beta1": TrlName("OptimizerConfig.b1"),
    "adam_beta2": TrlName("OptimizerConfig.b2"),
    "adam_epsilon": TrlName("OptimizerConfig.eps"),
    "max_grad_norm": TrlName("OptimizerConfig.max_grad_norm"),
    "seed": TrlName("PipelineConfig.seed", "JobConfig.seed seeds the demo model, warm-up and evaluation"),
    "bf16": TrlName("JobConfig.compute_dtype", "'auto' picks the faster dtype on this machine"),
    "gradient_checkpointing": TrlName("TrainerConfig.remat", "'layer' or 'dots'"),
    "report_to": TrlName("JobConfig.report_to"),
    "save_steps": TrlName("JobConfig.checkpoint_every"),
    "eval_steps": TrlName("JobConfig.eval_every"),
    "num_generations_eval": TrlName("JobConfig.eval_k", "k samples a held-out prompt: heldout_avg@K and "
                                    "heldout_pass@K beside the greedy accuracy"),
    "logging_steps": TrlName(None, "every step writes its row to WORKDIR/metrics.jsonl"),
    "output_dir": TrlName(None, "`streamrl train --workdir DIR`"),
    "model_name_or_path": TrlName("JobConfig.model"),
    "peft_config": TrlName("LoraConfig.rank", "LoRA is on when the rank is above 0 (LoraConfig.alpha, "
                           "LoraConfig.targets)"),
    "sync_ref_model": TrlName(None, "not built: the KL reference is the initial policy, frozen"),
    "lr": TrlName("OptimizerConfig.learning_rate", source="verl's (and OpenRLHF's)"),
    "n": TrlName("PipelineConfig.group_size", "samples per prompt", source="vLLM's and verl's"),
    "ppo_mini_batch_size": TrlName("TrainerConfig.mini_batches", "a count here: prompts_per_step / "
                                   "ppo_mini_batch_size mini-batches", source="verl's"),
    "ppo_epochs": TrlName("TrainerConfig.epochs", source="verl's"),
    "ppo_n_minibatches": TrlName("TrainerConfig.mini_batches", source="AReaL's"),
    "mini_batch_size": TrlName("TrainerConfig.mini_batches", "a count here: prompts_per_step / mini_batch_size",
                               source="Tunix's"),
    "max_epochs": TrlName("TrainerConfig.epochs", source="OpenRLHF's"),
    "max_tokens": TrlName("PipelineConfig.max_new_tokens", source="vLLM's"),
    "disable_dropout": TrlName(None, "the models here have no dropout"),
    "use_liger_loss": TrlName(None, "the log-probabilities are chunked over the vocabulary anyway "
                              "(TrainerConfig.logprob_chunk)"),
}


def trl_hint(name: str) -> str | None:
  """One clause saying what TRL's `name` is here, or None when `name` is not one of TRL's."""
  if name not in TRL_NAMES:
    return None
  key, note, source = TRL_NAMES[name]
  if key is None:
    return f"{name} is {source} name; it has no key here: {note}"
  return f"{name} is {source} name; here it is {key}" + (f" ({note})" if note else "")


def table() -> str:
  """docs/configuration.md's table of TRL's names, as Markdown."""
  rows = ["| TRL (GRPOConfig) | here | note |", "|---|---|---|"]
  for name, (key, note, source) in TRL_NAMES.items():
    whose = "" if source == TrlName._field_defaults["source"] else f" ({source})"
    rows.append(f"| `{name}`{whose} | {f'`{key}`' if key else '-'} | {note} |")
  return "\n".join(rows)
