"""How big a benchmark runs, decided in one place: `quick` (the suite's `--quick`: a few minutes for all of
them on a 2-core CPU, figures noisier) or full (each script's own sizes), and by backend (larger batches and
bfloat16 on accelerators). The suite sets STREAMRL_BENCH_QUICK=1 in a quick run's environment."""

from __future__ import annotations

import os

QUICK = os.environ.get("STREAMRL_BENCH_QUICK") == "1"


def size(full, quick):
  """`quick` in a quick run, else `full`."""
  return quick if QUICK else full


def on_accelerator() -> bool:
  """Whether jax runs on a GPU or TPU (imports jax: call it after the script has set its XLA flags)."""
  import jax

  return jax.default_backend() != "cpu"


def by_backend(cpu, accelerator):
  """`accelerator` on a GPU or TPU, else `cpu`: sizes that only pay off where memory bandwidth is high."""
  return accelerator if on_accelerator() else cpu


def compute_dtype() -> str:
  """The dtype models compute in: bfloat16 on accelerators, float32 on the CPU (which has no fast bfloat16)."""
  return by_backend("float32", "bfloat16")
