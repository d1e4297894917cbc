"""Every mesh of a run is built here: the mesh config (how devices split between the sampler and the
trainer), both meshes of one program, one role's mesh as its own program, the sampler's instance
sub-meshes, a process's local share of a mesh, and the one-device mesh of tools and warm-up."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "fsdp", "tensor")
EXPERT_AXES = ("fsdp", "tensor")  # the trainer mesh's axes a mixture's experts may be split over


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

  The engine replicates weights over "data" (one engine slot group per data shard) and splits
  them over "tensor"; the trainer shards them over "fsdp" and "tensor". A role run as its own program
  takes its first `<role>_devices` devices (0: all of its devices); the colocated mode puts both meshes on
  every device.
  """

  sampler_devices: int = 0  # sampler mesh devices; 0: all that trainer_devices leaves, else half (rounded up)
  trainer_devices: int = 0  # trainer mesh devices; 0: the devices the sampler leaves
  sampler_tensor_parallel: int = 1  # the sampler mesh's "tensor" axis; divides sampler_devices, the rest is "data"
  trainer_tensor_parallel: int = 1  # the trainer mesh's "tensor" axis; divides trainer_devices, the rest is "fsdp"
  # the trainer mesh axis a mixture's experts are split over (expert parallelism): "fsdp" or "tensor"; one device
  # on it: every expert on every device
  expert_axis: str = "fsdp"

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "expert_axis":
        if value not in EXPERT_AXES:
          raise ValueError(f"MeshConfig.expert_axis={value!r}; known: {list(EXPERT_AXES)}")
      elif value < 0 or (field.name.endswith("parallel") and value < 1):
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


def mesh_from_devices(devices, shape: MeshShape) -> Mesh:
  return Mesh(np.asarray(devices).reshape(shape.data, shape.fsdp, shape.tensor), AXES)


def single_device_mesh(device=None) -> Mesh:
  """A mesh of one device (default: this process's first): warm-up, tools, benchmarks."""
  return mesh_from_devices([device if device is not None else jax.local_devices()[0]], MeshShape(1, 1, 1))


CPU_DEVICES_RULE = ("one device for a colocated run, else one per core (at least 2, one per mesh), or as many as "
                    "MeshConfig asks; each device computes on all the process's cores")


def cpu_device_count(config: MeshConfig, shared: bool, cores: int) -> int:
  """CPU devices a one-program run forces (`CPU_DEVICES_RULE`). XLA:CPU sizes one pool of threads by the cores the
  process may use, and each device's programs compute on all of it: a 2048-square matmul on one of two devices runs
  at the two cores' rate, at one core's under `taskset -c 0`. So a colocated run (`shared`: one mesh) gets one
  device; over two, on a 2-core machine, its step took 1.35-1.50x as long (SmolLM2, `colocated_two_devices_over_one`
  in benchmarks/step_profile.py), its trainer calls and optimizer slowed by collectives and halved matrices. Two
  meshes get one device per core, at least 2 so both exist."""
  wanted = config.sampler_devices + config.trainer_devices
  return max(wanted, 1) if shared else max(2, cores, wanted)


def build_meshes(config: MeshConfig, devices=None) -> tuple[Mesh, Mesh]:
  """(sampler_mesh, trainer_mesh): the sampler takes the first devices, the trainer the next ones."""
  devices = list(jax.devices() if devices is None else devices)
  sampler, trainer = config.split(len(devices))
  return (mesh_from_devices(devices[: sampler.size], sampler),
          mesh_from_devices(devices[sampler.size: sampler.size + trainer.size], trainer))


def pipeline_meshes(config: MeshConfig, shared: bool, devices=None) -> tuple[Mesh, Mesh]:
  """(sampler_mesh, trainer_mesh) of a run in one program: disjoint (`build_meshes`), or with `shared` (the
  colocated mode) the same devices twice, laid out over "data" for the sampler and "fsdp" for the trainer."""
  devices = list(jax.devices() if devices is None else devices)
  if shared:
    return (mesh_from_devices(devices, MeshShape(len(devices), 1, 1)),
            mesh_from_devices(devices, MeshShape(1, len(devices), 1)))
  return build_meshes(config, devices)


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
  chosen = devices[:shape.size]
  idle = sorted({d.process_index for d in devices} - {d.process_index for d in chosen})
  if idle:  # a process of the role with no device in its mesh cannot take part in its programs
    raise ValueError(f"MeshConfig.{role}_devices={shape.size} leaves {role} process {idle[0]} no device: give each "
                     f"of its {len({d.process_index for d in devices})} processes at least one")
  return mesh_from_devices(chosen, shape)


def local_mesh(mesh: Mesh) -> Mesh:
  """This process's devices of `mesh`, over "fsdp" with the parent's tensor size where it divides them:
  what a process of a multi-process trainer runs its own work on (the output-length ranker)."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  tensor = mesh.shape.get("tensor", 1)
  tensor = tensor if len(local) % tensor == 0 else 1
  return mesh_from_devices(local, MeshShape(1, len(local) // tensor, tensor))


def split_mesh(mesh: Mesh, devices_per_instance: list[int]) -> list[Mesh]:
  """Disjoint sub-meshes of `mesh` (its devices in order), each ("data", "fsdp", "tensor") with the
  parent's tensor size and the rest on "data"."""
  devices = list(mesh.devices.flat)
  if sum(devices_per_instance) > len(devices):
    raise ValueError(f"instances ask for {sum(devices_per_instance)} devices; the sampler mesh has {len(devices)}")
  tensor = mesh.shape.get("tensor", 1)
  out, start = [], 0
  for n in devices_per_instance:
    t = tensor if n % tensor == 0 else 1
    out.append(mesh_from_devices(devices[start:start + n], MeshShape(n // t, 1, t)))
    start += n
  return out


def instance_meshes(sampler_mesh: Mesh, instances: int) -> list[Mesh]:
  """The sampler mesh itself for one instance; else `instances` equal disjoint sub-meshes of it."""
  if instances == 1:
    return [sampler_mesh]
  if sampler_mesh.devices.size % instances:
    raise ValueError(f"SchedulingConfig.max_instances={instances} does not divide the {sampler_mesh.devices.size} "
                     f"sampler devices")
  return split_mesh(sampler_mesh, [sampler_mesh.devices.size // instances] * instances)
