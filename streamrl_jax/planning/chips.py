"""The chips a plan is made for: public figures of each TPU generation, this machine's CPU measured, and topology
names (`v5p:4x4x2`, `v6e:16x16`, `cpu:8`) parsed into the devices their programs compile for.

TPU figures (Cloud TPU system architecture pages): bf16 peak per chip, HBM bandwidth, bidirectional inter-chip
interconnect bandwidth per chip (v4's is not stated there: its collectives get no time), and the chips a host of a
multi-host slice holds (a sampler program is one process, so at most one host's chips). A device's memory is what
TPU's compiler itself says it may use (its "available HBM" when a program does not fit: 15.75 GiB of a v5e's 16 GB,
95.74 GiB on a v5p, 31.25 GiB of a v6e's 32 GB). libtpu describes a v4 slice by its TensorCores, two a chip: a v4
device is half a chip (15.25 GiB, half its peak and bandwidth).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time

import jax
import jax.numpy as jnp

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
  """One device of a topology: what its programs may hold and how fast they can go."""

  name: str  # "TPU v5p", or this machine's CPU model
  platform: str  # "tpu" or "cpu": the backend its programs are traced for
  hbm_bytes: float  # memory per device (a TPU's: what its compiler lets a program use)
  peak_flops: float  # peak FLOP/s in the compute dtype (bfloat16 on a TPU; measured on a CPU)
  hbm_bytes_per_s: float  # memory bandwidth per device
  ici_bytes_per_s: float  # bidirectional interconnect per device; 0: unknown (collectives get no time)


GIB = 2 ** 30
TPUS = {
    "v4": Chip("TPU v4", "tpu", 15.25 * GIB, 275e12 / 2, 1200 * GB / 2, 0.0),
    "v5e": Chip("TPU v5 lite", "tpu", 15.75 * GIB, 197e12, 819 * GB, 400 * GB),
    "v5p": Chip("TPU v5p", "tpu", 95.74 * GIB, 459e12, 2765 * GB, 1200 * GB),
    "v6e": Chip("TPU v6e", "tpu", 31.25 * GIB, 918e12, 1638 * GB, 800 * GB),
}
DEVICES_PER_CHIP = {"v4": 2}  # libtpu's devices a chip of the topology name
NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$|^cpu:(\d+)$")


@dataclasses.dataclass(frozen=True)
class Topology:
  """A topology by name: its chip and how many of them."""

  name: str
  chip: Chip
  devices: int

  def device_list(self) -> list:
    """The topology's devices, to build meshes over: a TPU slice's from libtpu's topology description (no TPU
    needed), or this process's CPU devices."""
    if self.chip.platform == "cpu":
      found = jax.devices("cpu")
      if len(found) < self.devices:
        raise ValueError(f"--topology {self.name}: this process has {len(found)} CPU devices; start it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={self.devices} (`streamrl plan` does)")
      return found[:self.devices]
    from jax.experimental import topologies

    # libtpu takes a lock file for the chips of this host; a plan uses its compiler alone (another plan, a test, or a
    # run holding this host's TPU may have it)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
      description = topologies.get_topology_desc(topology_name=self.name, platform="tpu")
    except Exception as err:  # noqa: BLE001 - libtpu missing, or a shape it does not know
      raise ValueError(f"--topology {self.name}: TPU's compiler could not describe it ({_first_line(err)}); it needs "
                       f"the libtpu wheel that matches jax: pip install -e '.[tpu]'") from err
    # in id order: TPU's compiler refuses a program whose devices include device 0 and an id past their count
    # (libtpu 0.0.42 on v6e:8x8: devices 0, 1, 8, 9 fail, 2, 3, 10, 11 compile), so each side takes a run of ids
    return sorted(description.devices, key=lambda device: device.id)


def parse_topology(name: str) -> Topology:
  """'v5p:4x4x2' (a TPU generation and its chips' grid), or 'cpu:N' (this machine's CPU as N devices)."""
  match = NAME.match(name.strip())
  if not match:
    raise ValueError(f"--topology {name!r}: expected a TPU slice as GEN:AxB[xC] with GEN one of {sorted(TPUS)} "
                     f"(v5p:4x4x2, v6e:16x16), or cpu:N")
  if match.group(3):
    devices = int(match.group(3))
    return Topology(name, host_chip(devices), devices)
  grid = [int(n) for n in match.group(2).split("x")]
  return Topology(name, TPUS[match.group(1)], math.prod(grid) * DEVICES_PER_CHIP.get(match.group(1), 1))


@functools.cache
def host_chip(devices: int) -> Chip:
  """This machine's CPU as `devices` devices. They share its cores (XLA:CPU runs every device's programs on one pool
  of the process's threads), so each gets an equal share of its memory, of its float32 matmul rate and of its
  memory bandwidth, measured now (`measured_peak`): the rates of every device busy at once."""
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  flops, bandwidth = measured_peak()
  return Chip(cpu_model(), "cpu", memory / devices, flops / devices, bandwidth / devices, 0.0)


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as info:
      for line in info:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "CPU"


def measured_peak(size: int = 1024, rounds: int = 5) -> tuple[float, float]:
  """(float32 FLOP/s of a square matmul, bytes/s of a large copy) on this machine's first CPU device, the best of
  `rounds`: the peaks a CPU plan's roofline divides by."""
  device = jax.devices("cpu")[0]
  a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
  big = jax.device_put(jnp.ones((32 * 2**20,), jnp.float32), device)  # 128 MiB
  matmul, copy = jax.jit(lambda x: x @ x), jax.jit(lambda x: x * 1.0001)
  jax.block_until_ready((matmul(a), copy(big)))
  best_mm = best_copy = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    best_mm = min(best_mm, time.perf_counter() - start)
    start = time.perf_counter()
    jax.block_until_ready(copy(big))
    best_copy = min(best_copy, time.perf_counter() - start)
  return 2 * size ** 3 / best_mm, 2 * big.nbytes / best_copy


def _first_line(err: Exception) -> str:
  return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
