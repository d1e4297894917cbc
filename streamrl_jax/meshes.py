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
