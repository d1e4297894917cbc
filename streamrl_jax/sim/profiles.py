"""Hardware, model and workload profiles for the simulator, with the StreamRL paper's presets.

Facts carried from the paper: H800 (989.5 bf16 TFLOPS, 80 GB at 3.35 TB/s, relative cost 2.85),
H20 (148 TFLOPS, 96 GB at 4 TB/s, cost 1.00), and the 7B-on-H800 per-token decode latency of about
8, 10, 12, 15, 21 and 37 ms at batch 1, 32, 64, 128, 256 and 512. Other models and devices scale that
curve: the batch-1 part (weights read) with bytes over memory bandwidth, the growth with batch
(compute and KV reads) with FLOPs over peak.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  bf16_tflops: float
  memory_gb: float
  bandwidth_tbs: float
  cost_per_hour: float

  def __post_init__(self):
    for f in ("bf16_tflops", "memory_gb", "bandwidth_tbs"):
      if getattr(self, f) <= 0:
        raise ValueError(f"Hardware.{f} must be > 0, got {getattr(self, f)}")


H800 = Hardware("H800", 989.5, 80.0, 3.35, 2.85)
H20 = Hardware("H20", 148.0, 96.0, 4.0, 1.00)
HARDWARE = {h.name: h for h in (H800, H20)}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  name: str
  params_b: float
  layers: int
  kv_heads: int
  head_dim: int

  def kv_bytes_per_token(self) -> float:
    return 2 * self.layers * self.kv_heads * self.head_dim * 2  # keys and values, bf16


QWEN25 = {"7b": ModelSpec("Qwen2.5-7B", 7.6, 28, 4, 128), "32b": ModelSpec("Qwen2.5-32B", 32.8, 64, 8, 128),
          "72b": ModelSpec("Qwen2.5-72B", 72.7, 80, 8, 128)}
PTL_7B_H800 = {1: 8e-3, 32: 10e-3, 64: 12e-3, 128: 15e-3, 256: 21e-3, 512: 37e-3}


def scaled_ptl_curve(model: ModelSpec, hardware: Hardware, tensor_parallel: int, *,
                     tp_efficiency: float = 0.85) -> dict[int, float]:
  """PTL curve of `model` on `tensor_parallel` devices of `hardware`, scaled from 7B on one H800."""
  size = model.params_b / QWEN25["7b"].params_b
  parallel = tensor_parallel * (tp_efficiency if tensor_parallel > 1 else 1.0)
  fixed = PTL_7B_H800[1] * size * (H800.bandwidth_tbs / hardware.bandwidth_tbs) / parallel
  grow = size * (H800.bf16_tflops / hardware.bf16_tflops) / parallel
  return {b: fixed + (t - PTL_7B_H800[1]) * grow for b, t in PTL_7B_H800.items()}


def memory_max_batch(model: ModelSpec, hardware: Hardware, tensor_parallel: int, context_tokens: float,
                     cap: int = 512) -> int:
  """Sequences whose KV cache fits beside the weights (90% of memory usable)."""
  free = 0.9 * tensor_parallel * hardware.memory_gb * 1e9 - 2 * model.params_b * 1e9
  per_seq = model.kv_bytes_per_token() * context_tokens
  if free <= per_seq:
    raise ValueError(f"{model.name} on {tensor_parallel} x {hardware.name}: not even one sequence of "
                     f"{context_tokens:.0f} tokens fits beside the weights; raise tensor_parallel")
  return int(min(cap, free // per_seq))


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
  """Output lengths: a lognormal body clipped at `max_len`, or an empirical list (e.g. a real run's log)."""

  median: float = 1000.0
  sigma: float = 1.0
  max_len: int = 20000
  min_len: int = 1
  empirical: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_len < self.min_len or self.min_len < 1:
      raise ValueError(f"LengthDistribution needs 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
    if not self.empirical and (self.median <= 0 or self.sigma < 0):
      raise ValueError("LengthDistribution needs median > 0 and sigma >= 0")

  def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    if self.empirical:
      draws = rng.choice(np.asarray(self.empirical, float), n) * scale
    else:
      draws = rng.lognormal(math.log(self.median * scale), self.sigma, n)
    return np.clip(np.round(draws), self.min_len, self.max_len).astype(np.int64)
