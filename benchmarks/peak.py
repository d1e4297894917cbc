"""The machine's float32 matmul peak: the denominator of every MFU the benchmarks report, measured the same way
everywhere and in the same run as the work it divides.

One measurement: a 2048 x 2048 product of random normals on one device, one untimed call and the best of five.
`Peak` takes it before and after the timed work and keeps the larger, so an MFU is never inflated by a moment when
this shared machine ran slow (the README once quoted a peak of 215-222 GFLOP/s taken on a slow day, against 280-370
on others: an MFU of 0.47 that is 0.28-0.37 against the usual peak)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

SIZE, REPEATS = 2048, 5


def matmul_peak_flops(device=None, n: int = SIZE, repeats: int = REPEATS, dtype=jnp.float32) -> float:
  """Matmul FLOP/s on `device` (default: jax's first) in `dtype` (float32: every MFU's denominator)."""
  device = device or jax.devices()[0]
  a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
  b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), dtype), device)
  # float32 results: XLA:CPU multiplies bfloat16 into a bfloat16 result in float32, several times slower than into a
  # float32 one where the CPU has bfloat16 matrix units (the models' products do the same: `layers.tokens_matmul`)
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  matmul(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


class Peak:
  """The peak of one device over a run in `dtype` (float32: every MFU's denominator; bfloat16 beside it where a run
  computes in it): `measure()` before and after the timed work; `flops` the largest seen."""

  def __init__(self, device=None, dtype=jnp.float32):
    self.device, self.dtype, self.flops, self.measured = device, dtype, 0.0, 0

  def measure(self) -> float:
    self.flops = max(self.flops, matmul_peak_flops(self.device, dtype=self.dtype))
    self.measured += 1
    return self.flops

  def mfu(self, flops_per_s: float) -> float:
    """`flops_per_s` over the peak; asks for a measurement before and after the work."""
    if self.measured < 2:
      raise RuntimeError("an MFU needs the peak measured before and after the timed work (Peak.measure)")
    return flops_per_s / self.flops
