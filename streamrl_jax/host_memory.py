"""The host allocator of a run's process: glibc's malloc, told to give large buffers back.

By default glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so later arrays of a
few MiB come from its heap arenas, and with many threads (XLA's pools, tool and transport threads) it keeps many
arenas: freed weight versions and activations stay resident as fragments. On SmolLM2's RL run (6 steps of the
shipped config) the process grew from 5.3 to 8.8 GB by default; to 6.1 GB with a fixed 1 MiB threshold and 2
arenas from the environment (`MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2`); to 6.9 GB with the same set by
`limit_fragmentation` through `mallopt` when `streamrl` starts (some arenas exist by then).

A threshold of 1 MiB, though, maps every larger buffer afresh, and XLA:CPU's temporary buffers are larger: a
decode step over 32 slots of SmolLM2 reads cache slices of ~19 MB a layer, each mapped and faulted in again on
every call. A fixed threshold also fixes glibc's trim threshold at 128 KiB, so a large buffer freed at the top of
the heap is handed back at once and faulted in again by the next call. With both, a served request's prefill and
first step took 310-330 ms instead of 160 ms and a 4-step decode call 1.0-1.2 s instead of 0.38 s. So the mmap
threshold is 64 MiB (above those buffers, below a weight version's largest arrays: the embedding is 113 MB) and
the trim threshold 128 MiB (glibc's own rule, twice the mmap threshold); the trainer gives the heap's free pages
back after each step (`release_free_memory`). The equal-work async RL step went from 16.2 s to 14.3 s with the
mmap threshold alone, at the same peak memory (6.9 GB). The environment's settings, when given, are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -8, -3, -1  # glibc's mallopt parameters
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 128 << 20
ARENAS = 2


def _libc(name: str):
  """The C library's function `name`, or None where there is no such library or function (not glibc)."""
  path = ctypes.util.find_library("c")
  try:
    return getattr(ctypes.CDLL(path), name) if path else None
  except (OSError, AttributeError):
    return None


def limit_fragmentation() -> dict[str, bool]:
  """Fixes glibc's mmap threshold at 64 MiB, its trim threshold at 128 MiB and its arenas at 2 for this process
  (where glibc is the allocator, each unless the environment sets it: `MALLOC_MMAP_THRESHOLD_`,
  `MALLOC_TRIM_THRESHOLD_`, `MALLOC_ARENA_MAX`); returns which settings took."""
  mallopt = _libc("mallopt")
  if mallopt is None:
    return {}
  done = {}
  for env, param, value in (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                            ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                            ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENAS)):
    if env not in os.environ:
      done[env] = bool(mallopt(ctypes.c_int(param), ctypes.c_int(value)))
  return done


def release_free_memory() -> bool:
  """Returns the allocator's free heap pages to the system (glibc's `malloc_trim`); whether it did. Called once a
  trainer step has ended: the step's small buffers (transfers, checkpoint writes, host batches) leave free holes
  in the heap that glibc keeps resident otherwise."""
  trim = _libc("malloc_trim")
  return trim is not None and bool(trim(ctypes.c_size_t(0)))
