"""How many CPU devices a command forces (`meshes.cpu_device_count`), set through XLA_FLAGS before jax starts: the
`streamrl` command's and `streamrl_jax.train`'s choice."""

from __future__ import annotations

import os

from streamrl_jax.resources import cpu_cores


def default_host_devices(args=None) -> int:
  """CPU devices for a one-program run (`meshes.cpu_device_count`): one for a colocated `train`, else one per core
  this process may use, at least 2 so that sampler and trainer meshes both exist; as many as MeshConfig asks."""
  from streamrl_jax.meshes import MeshConfig, cpu_device_count

  mesh, shared = MeshConfig(), False
  if hasattr(args, "config") and hasattr(args, "set"):  # no --config: the demo's
    from streamrl_jax import gin_config

    gin_config.parse(gin_config.run_files(args.config), args.set)
    mesh, shared = gin_config.build(MeshConfig), getattr(args, "command", None) == "train" and shared_mesh()
  return cpu_device_count(mesh, shared, cpu_cores())


def shared_mesh() -> bool:
  """Whether the parsed config's mode time-shares one mesh (colocated); an unknown mode is refused later, by name."""
  import gin

  from streamrl_jax.modes import MODES, ModeSpec
  from streamrl_jax.pipeline.config import PipelineConfig

  mode = gin.get_bindings("PipelineConfig").get("mode", PipelineConfig.mode)
  return mode in MODES and ModeSpec.of(mode, 0).shared_mesh


def force_host_devices(count: int) -> None:
  """Gives the CPU backend `count` devices (two meshes on one host) unless XLA_FLAGS already says;
  only the CPU platform reads this flag, and only before jax starts."""
  flags = os.environ.get("XLA_FLAGS", "")
  if count > 0 and "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
