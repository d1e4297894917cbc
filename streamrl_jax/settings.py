"""Every field of a run's configs as flat `Class.field -> repr` settings: what a run writes to its workdir,
what a trainer and its samplers compare, what GKE manifests carry."""

from __future__ import annotations

import dataclasses

# Keys that moved to the config of the part that uses them: an old gin file or `--set` is refused naming the new
# key, and a workdir's saved settings are read under the new names (`renamed`).
MOVED_KEYS = {
    **{f"PipelineConfig.{f}": f"TrainerConfig.{f}" for f in ("chunk_rows", "packing", "pack_length", "chunk_tokens",
                                                               "precompile")},
    **{f"PipelineConfig.{f}": f"EnvConfig.{f}" for f in ("environment", "max_turns", "tool_threads", "tool_delay_s")},
    **{f"FlightConfig.{f}": f"ControllerConfig.{f}" for f in ("heartbeat_s", "lease_timeout_s", "sampler_timeout_s",
                                                             "finish_grace_s", "weight_fanout")},
    **{f"PipelineConfig.{f}": f"SamplerConfig.{f}" for f in ("quantize_on", "in_flight", "in_flight_cache")},
    "PipelineConfig.sampler_precision": "SamplerConfig.precision",
    **{f"{c}.{f}": f"WaitConfig.{f}" for f in ("queue_capacity", "stop_grace_s", "step_timeout_s")
       for c in ("PipelineConfig", "TrainerConfig")},
    **{f"PipelineConfig.{f}": f"ControllerConfig.{f}" for f in ("dynamic_sampling", "backfill_limit")},
    "ObjectiveConfig.value_coef": "ValueLossConfig.coef",
    **{f"JobConfig.{f}": f"DemoModelConfig.{f}" for f in ("hidden_size", "num_layers")},
    "ObjectiveConfig.value_clip": "ValueLossConfig.clip",
    "PipelineConfig.arm_name": "ArmsConfig.lead_name",
    "PipelineConfig.advantage": "WorkflowConfig.advantage",
    "PipelineConfig.arm_max_lag": "ArmsConfig.max_lag",
    "PipelineConfig.arm_programs": "ArmsConfig.programs",
    "JobConfig.model_dir": "JobConfig.model",
    "JobConfig.task": "TaskConfig.name",
    **{f"JobConfig.{f}": f"TaskConfig.{f}" for f in ("prompt_file", "prompt_key", "answer_key", "eval_file",
                                                      "eval_fraction", "chat", "system_prompt", "max_digits",
                                                      "sum_digits", "sum_terms", "multiply_digits")},
    **{f"GKEConfig.trainer_{f}": f"GKETrainerConfig.{f}" for f in ("topology", "hosts", "max_restarts")},
    **{f"GKEConfig.sampler_{f}": f"GKESamplersConfig.{f}" for f in ("topology", "replicas", "max_restarts",
                                                                     "pod_retries")},
    **{f"GKEConfig.{f}": f"GKEPortsConfig.{f}" for f in ("flight_port", "coordinator_port", "relay_port")},
}


def renamed(settings: dict[str, str]) -> dict[str, str]:
  """Saved settings with each moved key under its new name (a workdir written before the key moved)."""
  return {MOVED_KEYS.get(key, key): value for key, value in settings.items()}


def flat_settings(*configs) -> dict[str, str]:
  """{"PipelineConfig.mode": "'async'", "EngineConfig.num_slots": "32", ...}: every field of the given config
  dataclasses and of those nested in them, by the class name gin binds it under, values as repr."""
  out = {}
  for config in configs:
    for field in dataclasses.fields(config):
      value = getattr(config, field.name)
      if "bound_by" in field.metadata:  # not a gin key (ArmsConfig.followers: --arms files)
        continue
      if dataclasses.is_dataclass(value):
        out.update(flat_settings(value))
      else:
        out[f"{type(config).__name__}.{field.name}"] = repr(value)
  return out
