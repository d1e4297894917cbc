"""Arm files as the config layer reads them (`--arms FILE ...`): each parsed over the lead's configs becomes an
`ArmConfig`, and what an arm may not change (anything that shapes the shared stream) is refused naming the arm and
the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from streamrl_jax.arms.config import ARM_KEYS, ArmConfig, check_arm_names, stream_settings
from streamrl_jax.config_types import ConfigError
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.job.config import JobConfig
from streamrl_jax.settings import flat_settings


def arms_from_configs(lead: PipelineConfig, lead_job: JobConfig, parsed: list[tuple[str, PipelineConfig, JobConfig]],
                      model_specs: Callable | None = None) -> tuple[ArmConfig, ...]:
  """`ArmConfig`s of arm files parsed over the lead's configs: `parsed` holds (name, PipelineConfig, JobConfig)
  per file. A key outside `ARM_KEYS` set differently from the lead is refused naming the arm and the key; a model
  of another shape or tokenizer says which. `model_specs(job)` gives (ModelConfig, tokenizer) to compare."""
  lead_settings = stream_settings(flat_settings(lead, lead_job))
  arms = []
  for name, config, job in parsed:
    if job.model != lead_job.model or job.demo != lead_job.demo:
      raise ConfigError(_model_difference(name, lead_job, job, model_specs))
    settings = stream_settings(flat_settings(config, job))
    for key in sorted(settings):
      if settings[key] != lead_settings.get(key):
        raise ConfigError(f"arm {name!r}: {key}={settings[key]} differs from the lead's ({lead_settings.get(key)}); "
                          f"arms share one stream and may only change "
                          f"{', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in ARM_KEYS)}")
    arms.append(ArmConfig(name=name, advantage=config.workflow.estimator, objective=config.trainer.objective,
                          optimizer=config.trainer.optimizer, seed=config.seed))
  check_arm_names(lead.arms.lead_name, arms)
  return tuple(arms)


def _model_difference(name: str, lead_job: JobConfig, job: JobConfig, model_specs: Callable | None) -> str:
  """One line naming how an arm's model differs from the lead's (shape, tokenizer, or only its weights)."""
  given = f"arm {name!r}: JobConfig.model={job.model!r}, the lead's {lead_job.model!r}"
  if model_specs is not None:
    (lead_model, lead_tok), (model, tok) = model_specs(lead_job), model_specs(job)
    if lead_model != model:
      diff = next(f.name for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(lead_model, f.name))
      return (f"{given}: the models differ in shape ({diff} {getattr(model, diff)} vs {getattr(lead_model, diff)}); "
              "every arm trains a copy of the lead's initial policy")
    if type(tok) is not type(lead_tok) or tok.vocab_size != lead_tok.vocab_size:
      return f"{given}: the tokenizers differ; arms train on one stream of token ids, so one tokenizer"
  return f"{given}: every arm starts from the lead's initial checkpoint; leave JobConfig.model to the lead"
