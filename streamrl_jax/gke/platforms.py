"""The accelerators a GKE launch can target: node selectors, resources, slice shapes and XLA flags.

A TPU role runs on one slice, named by its topology (`2x4`: 8 chips); the slice's hosts are the role's
processes. A GPU role runs on whole nodes (hosts), each with its GPUs. The flags are the ones the XLA and
libtpu teams recommend for overlapping collectives with compute; each is documented in launchers/README.md.
"""

from __future__ import annotations

import dataclasses
import math
import re

TPU_LIBTPU_ARGS = " ".join((
    "--xla_tpu_enable_latency_hiding_scheduler=true",  # schedule collectives early, overlap them with compute
    "--xla_tpu_enable_async_collective_fusion=true",  # run fused collectives asynchronously ...
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",  # ... all-gathers included (FSDP)
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",  # ... and across loop iterations
    "--xla_tpu_overlap_compute_collective_tc=true",  # let the TensorCore compute while they run
    "--xla_enable_async_all_gather=true",
))
GPU_XLA_FLAGS = " ".join((
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # overlap NCCL collectives with compute
    "--xla_gpu_enable_highest_priority_async_stream=true",  # collectives on a high-priority stream
))


@dataclasses.dataclass(frozen=True)
class Platform:
  name: str
  kind: str  # "tpu" or "gpu"
  accelerator: str  # the node label value that selects it
  resource: str  # the extended resource a container requests
  per_host: tuple[int, ...]  # accelerators one host can hold; the first is the multi-host default
  topology_dims: int  # 2 (v5e, v6e) or 3 (v5p); 0: GPUs (no topology)
  max_single_host: int  # the most chips a single-host slice has
  env: tuple[tuple[str, str], ...]  # the recommended environment: platform selection and XLA flags
  machine: str  # what `gcloud container node-pools create --machine-type` takes, for the docs

  def selector(self, topology: str) -> dict[str, str]:
    if self.kind == "gpu":
      return {"cloud.google.com/gke-accelerator": self.accelerator}
    return {"cloud.google.com/gke-tpu-accelerator": self.accelerator, "cloud.google.com/gke-tpu-topology": topology}


PLATFORMS = {p.name: p for p in (
    Platform("tpu-v5e", "tpu", "tpu-v5-lite-podslice", "google.com/tpu", (4, 1, 8), 2, 8,
             (("JAX_PLATFORMS", "tpu"), ("LIBTPU_INIT_ARGS", TPU_LIBTPU_ARGS)), "ct5lp-hightpu-{n}t"),
    Platform("tpu-v5p", "tpu", "tpu-v5p-slice", "google.com/tpu", (4,), 3, 4,
             (("JAX_PLATFORMS", "tpu"), ("LIBTPU_INIT_ARGS", TPU_LIBTPU_ARGS)), "ct5p-hightpu-4t"),
    Platform("tpu-v6e", "tpu", "tpu-v6e-slice", "google.com/tpu", (4, 1, 8), 2, 8,
             (("JAX_PLATFORMS", "tpu"), ("LIBTPU_INIT_ARGS", TPU_LIBTPU_ARGS)), "ct6e-standard-{n}t"),
    Platform("gpu-a3", "gpu", "nvidia-h100-80gb", "nvidia.com/gpu", (8, 1, 2, 4), 0, 8,
             (("JAX_PLATFORMS", "cuda"), ("XLA_FLAGS", GPU_XLA_FLAGS), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")),
             "a3-highgpu-{n}g"),
)}


@dataclasses.dataclass(frozen=True)
class RoleShape:
  """Where one role (or one engine instance) runs: its slice topology (TPU), hosts, and accelerators per host."""

  topology: str
  hosts: int
  per_host: int

  @property
  def accelerators(self) -> int:
    return self.hosts * self.per_host


def role_shape(platform: Platform, key: str, topology: str, hosts: int, per_host: int) -> RoleShape:
  """The role's shape from its settings (`hosts`/`per_host` 0: the platform's default); errors name `key`."""
  if platform.kind == "gpu":
    per_host = per_host or platform.per_host[0]
    if per_host not in platform.per_host:
      raise ValueError(f"GKEConfig.accelerators_per_host: {platform.name} nodes hold {sorted(platform.per_host)} GPUs, "
                       f"not {per_host}")
    return RoleShape("", hosts or 1, per_host)
  chips = _topology_chips(platform, key, topology)
  if not per_host:
    per_host = chips if chips <= platform.max_single_host and not hosts or hosts == 1 else platform.per_host[0]
  if per_host not in platform.per_host:
    raise ValueError(f"GKEConfig.accelerators_per_host: {platform.name} hosts hold {sorted(platform.per_host)} chips, "
                     f"not {per_host}")
  if chips % per_host or (per_host > 4 and chips != per_host):
    raise ValueError(f"{key} {topology!r} ({chips} chips) does not split into hosts of {per_host} chips")
  if hosts and hosts != chips // per_host:
    raise ValueError(f"{key} {topology!r} has {chips} chips: {chips // per_host} hosts of {per_host}, "
                     f"not {hosts}")
  return RoleShape(topology, chips // per_host, per_host)


def _topology_chips(platform: Platform, key: str, topology: str) -> int:
  dims = platform.topology_dims
  if not re.fullmatch(r"\d+(x\d+)*", topology or "") or topology.count("x") != dims - 1:
    example = "2x4" if dims == 2 else "2x2x2"
    raise ValueError(f"{key} {topology!r}: {platform.name} topologies have {dims} dimensions, e.g. "
                     f"{example!r}")
  sizes = [int(d) for d in topology.split("x")]
  if any(s < 1 or s & (s - 1) for s in sizes):
    raise ValueError(f"{key} {topology!r}: every dimension must be a power of two")
  if dims == 2 and (sizes[0] > sizes[1] or sizes[1] > 2 * sizes[0]):
    raise ValueError(f"{key} {topology!r}: {platform.name} slices are AxB with A <= B <= 2A "
                     "(1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16)")
  chips = math.prod(sizes)
  if dims == 3 and chips % 4:
    raise ValueError(f"{key} {topology!r}: {platform.name} slices hold a multiple of 4 chips")
  return chips
