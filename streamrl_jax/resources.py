"""What this process holds of the machine: its CPU cores and resident memory."""

from __future__ import annotations

import os
import resource
import sys


def resident_mb() -> float:
  """This process's resident set size in MiB (Linux: now, from /proc; elsewhere: the peak so far)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def cpu_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
