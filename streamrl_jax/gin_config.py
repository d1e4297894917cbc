"""gin bindings for the typed config dataclasses: parse files and `--set` overrides, then build.

Only this module knows gin; the dataclasses stay plain. A gin file writes e.g.
`MeshConfig.sampler_devices = 4`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import gin

from streamrl_jax.envs.config import EnvConfig
from streamrl_jax.gke.launch_config import GKEConfig
from streamrl_jax.meshes import MeshConfig
from streamrl_jax.models.config import ModelConfig, RopeScaling
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.controller.config import ControllerConfig
from streamrl_jax.pipeline.job_config import JobConfig
from streamrl_jax.rewards.config import RewardConfig
from streamrl_jax.sampling import EngineConfig
from streamrl_jax.scheduling import RankerConfig, SchedulingConfig
from streamrl_jax.streaming.flight_config import FlightConfig
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, TrainerConfig

CONFIG_DIRS = (Path(__file__).resolve().parent.parent / "configs",  # a checkout (pip install -e .)
               Path(sys.prefix) / "share" / "streamrl_jax" / "configs")  # an install (pyproject data-files)
DEMO_CONFIG = next((d / "demo_cpu.gin" for d in CONFIG_DIRS if (d / "demo_cpu.gin").is_file()),
                   CONFIG_DIRS[0] / "demo_cpu.gin")
def example_dir(name: str) -> Path:
  """`examples/NAME` of a checkout, or of an install (pyproject data-files); an error names both places."""
  for root in (Path(__file__).resolve().parent.parent, Path(sys.prefix) / "share" / "streamrl_jax"):
    if (root / "examples" / name).is_dir():
      return root / "examples" / name
  raise FileNotFoundError(f"example {name!r} is in neither {CONFIG_DIRS[0].parent / 'examples'} nor "
                          f"{Path(sys.prefix) / 'share' / 'streamrl_jax' / 'examples'}")


CONFIG_CLASSES = (MeshConfig, ModelConfig, RopeScaling, EngineConfig, OptimizerConfig, ObjectiveConfig,
                  RankerConfig, SchedulingConfig, RewardConfig, TrainerConfig, EnvConfig, ControllerConfig, PipelineConfig,
                  JobConfig, FlightConfig, GKEConfig)
for _cls in CONFIG_CLASSES:
  gin.external_configurable(_cls, name=_cls.__name__)


# Keys that moved to the config of the part that uses them: an old file or `--set` is refused naming the new key.
MOVED_KEYS = {
    **{f"PipelineConfig.{f}": f"TrainerConfig.{f}" for f in ("chunk_rows", "packing", "pack_length", "chunk_tokens",
                                                               "precompile")},
    **{f"PipelineConfig.{f}": f"EnvConfig.{f}" for f in ("environment", "max_turns", "tool_threads", "tool_delay_s")},
    **{f"FlightConfig.{f}": f"ControllerConfig.{f}" for f in ("heartbeat_s", "lease_timeout_s", "sampler_timeout_s",
                                                             "finish_grace_s", "weight_fanout")},
}
# Keys a run derives from another, set once there.
DERIVED_KEYS = {"EngineConfig.max_new_tokens": "PipelineConfig.max_new_tokens"}
_KEY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*)\s*=", re.MULTILINE)


def check_moved_keys(config_files=(), bindings=()) -> None:
  """Refuses a binding of a key that moved or is derived, naming the key to set and where it was written."""
  sources = [(f"--set {b!r}", b) for b in bindings]
  sources += [(str(f), Path(f).read_text()) for f in config_files if Path(f).is_file()]
  for where, text in sources:
    for key in _KEY.findall(text):
      if key in MOVED_KEYS:
        raise ValueError(f"{key} moved: set {MOVED_KEYS[key]} instead ({where})")
      if key in DERIVED_KEYS:
        raise ValueError(f"{key} is set from {DERIVED_KEYS[key]}: bind that one alone ({where})")


def parse(config_files=(), bindings=()) -> None:
  """Parses gin files and binding strings; a mistake is raised as ValueError naming it."""
  check_moved_keys(config_files, bindings)
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([str(f) for f in config_files], list(bindings))
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


def run_files(config_files) -> list[str]:
  """The gin files of a run: those given, else the CPU demo's (`configs/demo_cpu.gin`, the one place its
  values are written)."""
  if config_files:
    return list(config_files)
  if not DEMO_CONFIG.is_file():
    raise FileNotFoundError(f"no --config given, and the CPU demo's demo_cpu.gin is in none of "
                            f"{[str(d) for d in CONFIG_DIRS]}; pass --config FILE")
  return [str(DEMO_CONFIG)]


def build_run() -> tuple[PipelineConfig, JobConfig]:
  """The pipeline config with its nested parts, each from its own bindings, and the job config."""
  parts = dict(mesh=build(MeshConfig), engine=build(EngineConfig), optimizer=build(OptimizerConfig),
               objective=build(ObjectiveConfig), scheduling=build(SchedulingConfig, ranker=build(RankerConfig)),
               reward=build(RewardConfig), trainer=build(TrainerConfig), env=build(EnvConfig),
               controller=build(ControllerConfig))
  return build(PipelineConfig, **parts), build(JobConfig)


def build_flight() -> FlightConfig:
  """How trainer and samplers reach each other across processes (`FlightConfig` bindings)."""
  return build(FlightConfig)


def build_gke() -> GKEConfig:
  """Where a run goes on GKE (`GKEConfig` bindings; `streamrl launch gke`)."""
  return build(GKEConfig)

