"""Every field of a run's configs as flat `Class.field -> repr` settings: what a run writes to its workdir,
what a trainer and its samplers compare, what GKE manifests carry."""

from __future__ import annotations

import dataclasses


def flat_settings(*configs) -> dict[str, str]:
  """{"PipelineConfig.mode": "'async'", "EngineConfig.num_slots": "32", ...}: every field of the given config
  dataclasses and of those nested in them, by the class name gin binds it under, values as repr."""
  out = {}
  for config in configs:
    for field in dataclasses.fields(config):
      value = getattr(config, field.name)
      if "bound_by" in field.metadata:  # not a gin key (PipelineConfig.arms: --arms files)
        continue
      if dataclasses.is_dataclass(value):
        out.update(flat_settings(value))
      else:
        out[f"{type(config).__name__}.{field.name}"] = repr(value)
  return out
