"""Typed, frozen configuration dataclasses of every part; validated on construction.

gin binds these in `configs/` (see `streamrl_jax.gin_config`); library code takes them as arguments.
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.models.config import ModelConfig, RopeScaling

__all__ = ["MeshConfig", "MeshShape", "ModelConfig", "RopeScaling", "flat_settings"]


def flat_settings(*configs) -> dict[str, str]:
  """{"PipelineConfig.mode": "'async'", "EngineConfig.num_slots": "32", ...}: every field of the given config
  dataclasses and of those nested in them, by the class name gin binds it under, values as repr."""
  out = {}
  for config in configs:
    for field in dataclasses.fields(config):
      value = getattr(config, field.name)
      if dataclasses.is_dataclass(value):
        out.update(flat_settings(value))
      else:
        out[f"{type(config).__name__}.{field.name}"] = repr(value)
  return out


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """Sizes of the ("data", "fsdp", "tensor") axes of one mesh."""

  data: int
  fsdp: int
  tensor: int

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """How devices split between the sampler mesh and the trainer mesh.

  The sampler replicates weights over "data" (one engine slot group per data shard) and splits
  them over "tensor"; the trainer shards them over "fsdp" and "tensor".
  0 devices means: the sampler gets half (rounded up), the trainer the rest.
  """

  sampler_devices: int = 0
  trainer_devices: int = 0
  sampler_tensor_parallel: int = 1
  trainer_tensor_parallel: int = 1

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value < 0 or (field.name.endswith("parallel") and value < 1):
        raise ValueError(f"MeshConfig.{field.name}={value} is out of range")

  def split(self, num_devices: int) -> tuple[MeshShape, MeshShape]:
    """(sampler, trainer) mesh shapes over `num_devices` devices; raises if they do not fit."""
    if num_devices < 2:
      raise ValueError(f"two meshes need at least 2 devices, found {num_devices}")
    sampler = self.sampler_devices or (num_devices - self.trainer_devices if self.trainer_devices
                                       else (num_devices + 1) // 2)
    trainer = self.trainer_devices or num_devices - sampler
    if sampler < 1 or trainer < 1 or sampler + trainer > num_devices:
      raise ValueError(f"MeshConfig asks for {sampler} sampler + {trainer} trainer devices, "
                       f"but {num_devices} are available")
    for name, n, tp in (("sampler", sampler, self.sampler_tensor_parallel),
                        ("trainer", trainer, self.trainer_tensor_parallel)):
      if n % tp:
        raise ValueError(f"MeshConfig.{name}_tensor_parallel={tp} does not divide {n} {name} devices")
    return (MeshShape(data=sampler // self.sampler_tensor_parallel, fsdp=1, tensor=self.sampler_tensor_parallel),
            MeshShape(data=1, fsdp=trainer // self.trainer_tensor_parallel, tensor=self.trainer_tensor_parallel))
