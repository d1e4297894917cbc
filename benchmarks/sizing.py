"""How big a benchmark runs, decided in one place: `quick` (the suite's `--quick`: every benchmark in minutes on a
2-core CPU, figures noisier, judged only where its goal holds at any size) or full (each script's own sizes). The
suite sets STREAMRL_BENCH_QUICK=1 in a quick run's environment. Sizes do not change with the backend: on a GPU or
TPU the same work runs in float32, so a figure there is the CPU's workload on that device."""

from __future__ import annotations

import os

QUICK = os.environ.get("STREAMRL_BENCH_QUICK") == "1"


def size(full, quick):
  """`quick` in a quick run, else `full`."""
  return quick if QUICK else full
