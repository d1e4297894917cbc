"""How much of its device's memory a program is compiled to use.

TPU's compiler schedules a program within the memory it is told its device has: its latency-hiding scheduler keeps
work back (a layer's weight-gradient products and their reduce-scatters, to overlap them with later layers) as long as
that memory allows. It does not know what other programs keep on the device beside it, such as the optimizer's
moments beside the trainer's gradient call or the version being published. Told its device's memory less what lies
beside it, at `HEADROOM`, it schedules within that or refuses at compile time, naming the temporaries it needs, rather
than failing at run time (Qwen3-8B's gradient call on a v6e chip: 24.0 GiB of temporaries told the whole chip, 22.5
told what is left beside the moments; `streamrl plan`, docs/plans.md).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import numpy as np

from streamrl_jax.models.compile_target import target_backend

HEADROOM = 0.9  # of a device's memory, what its programs and the arrays beside them may hold (the runtime's and the
# allocator's own use beside XLA's buffers)
MIB = 2**20

_planned: contextvars.ContextVar[float | None] = contextvars.ContextVar("planned_device_memory", default=None)


@contextlib.contextmanager
def planned_memory(device_bytes: float) -> Iterator[None]:
  """While inside, programs are compiled for devices of `device_bytes` (a plan's chip, whose devices are abstract and
  report no memory)."""
  token = _planned.set(device_bytes)
  try:
    yield
  finally:
    _planned.reset(token)


def device_bytes(tree) -> int:
  """Bytes one device holds of a tree of arrays or shapes placed on a mesh (`jax.ShapeDtypeStruct`s with shardings):
  the largest shard of each leaf."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def memory_of(device) -> tuple[float | None, int]:
  """(the memory a program on `device` may use, the bytes already in use there): a plan's chip and 0, else what the
  device reports; (None, 0) where it reports nothing (a CPU)."""
  planned = _planned.get()
  if planned is not None:
    return planned, 0
  try:
    stats = device.memory_stats() or {}
  except Exception:  # noqa: BLE001 - jax raises for devices that keep no statistics (abstract or not addressable)
    stats = {}
  return stats.get("bytes_limit"), int(stats.get("bytes_in_use", 0))


def memory_limit(device, beside: int, resident: int = 0) -> dict:
  """Compiler options keeping a TPU program within `HEADROOM` of `device`'s memory less what lies beside it: `beside`
  bytes of its owner's that it does not take (the optimizer's moments, the version being published), and whatever
  else the device already holds beyond `resident` (all its owner's arrays there now: another part's on shared
  devices). {} off a TPU, or where the memory is not known."""
  if target_backend() != "tpu":
    return {}
  total, in_use = memory_of(device)
  if not total:
    return {}
  limit = HEADROOM * total - beside - max(in_use - resident, 0)
  if limit < MIB:
    raise ValueError(f"{device}: {beside / 2**30:.2f} GiB beside the program and {in_use / 2**30:.2f} GiB in use "
                     f"leave nothing of the {HEADROOM} x {total / 2**30:.2f} GiB it may use")
  return {"xla_tpu_max_hbm_size_mib": str(int(limit // MIB))}
