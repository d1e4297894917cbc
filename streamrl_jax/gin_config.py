"""gin bindings for the typed config dataclasses: parse files and `--set` overrides, then build.

Only this module knows gin; the dataclasses stay plain. A gin file writes e.g.
`MeshConfig.sampler_devices = 4`.
"""

from __future__ import annotations

import dataclasses

import gin

from streamrl_jax.config import MeshConfig, ModelConfig, RopeScaling

CONFIG_CLASSES = (MeshConfig, ModelConfig, RopeScaling)
for _cls in CONFIG_CLASSES:
  gin.external_configurable(_cls, name=_cls.__name__)


def parse(config_files=(), bindings=()) -> None:
  """Parses gin files and binding strings; a mistake is raised as ValueError naming it."""
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(list(config_files), list(bindings))
  except (ValueError, KeyError, SyntaxError, IOError) as err:
    raise ValueError(f"bad gin configuration: {err}") from err


def build(cls, **defaults):
  """An instance of a config dataclass from its gin bindings (over `defaults`)."""
  if cls not in CONFIG_CLASSES:
    raise TypeError(f"{cls.__name__} is not a gin-bindable config; known: {[c.__name__ for c in CONFIG_CLASSES]}")
  bound = gin.get_bindings(cls.__name__)
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(bound) - known)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} bindings {unknown}; fields: {sorted(known)}")
  return cls(**{**defaults, **bound})
