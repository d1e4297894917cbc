"""A trainer call's rows laid out by the process that holds them (a trainer of several processes).

Each trainer process holds the tokens of the samples sent to it alone; every process knows every row's place. A
call's global batch is laid out so that each row lies in rows of the batch that only its owner's devices hold, and
each process builds its own devices' part from what it holds (`jax.make_array_from_callback`): no sample's tokens
cross between the trainer's processes. Rows without a valid token carry no loss and are left out.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding


class BatchNotSplit(ValueError):
  """The trainer's mesh does not split the batch axis across its processes, so no row is one process's alone."""


def process_rows(sharding: NamedSharding, shape: tuple[int, int], processes: int) -> list[np.ndarray]:
  """The rows of a batch of `shape` that only process p's devices hold, for each p, in order."""
  holders: dict[int, set] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    for row in range(*index[0].indices(shape[0])):
      holders.setdefault(row, set()).add(device.process_index)
  rows = [[] for _ in range(processes)]
  for row in sorted(holders):
    if len(holders[row]) == 1:
      rows[next(iter(holders[row]))].append(row)
  return [np.asarray(r, np.int64) for r in rows]


def owned_layout(values: dict, owners: np.ndarray, length: int, rows_for: Callable[[int], int],
                 sharding_for: Callable[[tuple[int, int]], NamedSharding], processes: int) -> tuple[dict, tuple]:
  """`values` ([rows, <= length] arrays of one call, row i held by process `owners[i]` of `processes`) placed in a
  global batch of (rows_for(n), length) rows, each on its owner's devices, n a power of two per process (so that calls
  take few shapes); returns (the global arrays, their shape). `rows_for(n)`: the bucketed row count of at least n
  rows."""
  out, shape, _ = owned_slots(values, owners, length, rows_for, sharding_for, processes)
  return out, shape


def owned_slots(values: dict, owners: np.ndarray, length: int, rows_for: Callable[[int], int],
                sharding_for: Callable[[tuple[int, int]], NamedSharding],
                processes: int) -> tuple[dict, tuple, np.ndarray]:
  """`owned_layout`, and where each row went: its row of the global batch, -1 for a row without a valid token (left
  out): what a frozen model's scores of the global batch are read back by."""
  keep = np.asarray(values["valid"]).any(axis=1)
  counts = np.bincount(owners[keep], minlength=processes)
  most = max(int(counts.max(initial=0)), 1)
  rows = rows_for((1 << (most - 1).bit_length()) * processes)  # a power of two a process: few shapes to compile
  while True:
    slots = process_rows(sharding_for((rows, length)), (rows, length), processes)
    if all(len(s) >= c for s, c in zip(slots, counts)):
      break
    if not any(len(s) for s in slots):
      raise BatchNotSplit("the trainer's mesh gives no batch row to one process alone: a trainer of several "
                          "processes needs its batch axes (MeshConfig's data and fsdp) split across them")
    rows = rows_for(rows + 1)
  where = np.full(len(owners), -1, np.int64)
  for process, slot in enumerate(slots):
    mine = np.flatnonzero(keep & (owners == process))
    where[mine] = slot[:len(mine)]
  out = {}
  for key, value in values.items():
    value = np.asarray(value)
    placed = np.zeros((rows, length) + value.shape[2:], value.dtype)
    placed[where[keep], :value.shape[1]] = value[keep]
    out[key] = placed
  return out, (rows, length), where


def put_owned(arrays: dict, sharding: NamedSharding) -> dict:
  """Each process's devices' part of the global `arrays` from its own copy (the others' rows may differ there)."""
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index]) for k, v in arrays.items()}
