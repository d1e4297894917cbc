"""Builds the sampler and trainer meshes on disjoint devices from a `MeshConfig`."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from streamrl_jax.config import MeshConfig, MeshShape

AXES = ("data", "fsdp", "tensor")


def mesh_from_devices(devices, shape: MeshShape) -> Mesh:
  return Mesh(np.asarray(devices).reshape(shape.data, shape.fsdp, shape.tensor), AXES)


def build_meshes(config: MeshConfig, devices=None) -> tuple[Mesh, Mesh]:
  """(sampler_mesh, trainer_mesh): the sampler takes the first devices, the trainer the next ones."""
  devices = list(jax.devices() if devices is None else devices)
  sampler, trainer = config.split(len(devices))
  return (mesh_from_devices(devices[: sampler.size], sampler),
          mesh_from_devices(devices[sampler.size: sampler.size + trainer.size], trainer))


def role_mesh_shape(config: MeshConfig, role: str, num_devices: int) -> MeshShape:
  """The mesh shape of one role running as its own program over `num_devices` devices (see `role_mesh`);
  raises, naming the key, when the config does not fit."""
  if role not in ("sampler", "trainer"):
    raise ValueError(f"unknown role {role!r}")
  wanted = getattr(config, f"{role}_devices") or num_devices
  tensor = getattr(config, f"{role}_tensor_parallel")
  if wanted > num_devices:
    raise ValueError(f"MeshConfig.{role}_devices={wanted} but this {role} has {num_devices} devices")
  if wanted % tensor:
    raise ValueError(f"MeshConfig.{role}_tensor_parallel={tensor} does not divide {wanted} {role} devices")
  return MeshShape(wanted // tensor, 1, tensor) if role == "sampler" else MeshShape(1, wanted // tensor, tensor)


def role_mesh(config: MeshConfig, role: str, devices=None) -> Mesh:
  """The mesh of one role running as its own program: its first `MeshConfig.<role>_devices` devices (0: all),
  laid out as that role's mesh in `build_meshes` (the sampler over "data", the trainer over "fsdp")."""
  devices = list(jax.devices() if devices is None else devices)
  shape = role_mesh_shape(config, role, len(devices))
  return mesh_from_devices(devices[:shape.size], shape)
