"""The machine's roofline, and SmolLM2's bfloat16 decode step against it.

1. The machine, measured in this run: matmul FLOP/s in float32 (`peak.py`, the denominator of every MFU) and in
   bfloat16 (an n x n product, n = 8192 on an accelerator and 2048 on a CPU, best of 5), and memory bandwidth (a
   512 MiB bfloat16 array doubled on the device: bytes read plus written over the best of 5 seconds).
2. The decode step: SmolLM2-135M's shapes (30 layers, hidden 576, vocabulary 49,152; random weights, since speed
   does not depend on their values) in bfloat16, weights and activations, on the contiguous engine with 64 rows
   busy, prompts of 128 tokens and a 256-token attention window, 4 steps per call; a step is the median call over
   4. Its bytes are what a step must read: every weight once (the tied embedding is the output head) plus the
   keys and values of 64 rows over the window. `roofline_step_s` is the larger of bytes over bandwidth and FLOPs
   over the bfloat16 peak; `decode_vs_roofline` the measured step over it (goal <= 2 on an accelerator; a CPU is
   compute-bound there and only reports it).

Prints one JSON object as its last line. A quick run (`benchmarks/sizing.py`) times 8 calls instead of 24.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import matmul_peak_flops  # noqa: E402
from precision import SMOLLM2_SHAPE  # noqa: E402
from sizing import size  # noqa: E402

from streamrl_jax.meshes import single_device_mesh  # noqa: E402
from streamrl_jax.models import Transformer  # noqa: E402
from streamrl_jax.models.kv_cache import kv_cache_bytes  # noqa: E402
from streamrl_jax.sampling import EngineConfig, make_engine  # noqa: E402
from streamrl_jax.types import SamplingParams  # noqa: E402

ROWS, PROMPT, WINDOW, STEPS_PER_CALL = 64, 128, 256, 4
CALLS = size(24, 8)  # decode calls timed (the first two, which compile, dropped)
BANDWIDTH_BYTES, REPEATS = 512 * 2**20, 5


def bandwidth_bytes_per_s(device, nbytes: int = BANDWIDTH_BYTES, repeats: int = REPEATS) -> float:
  """Bytes read plus written per second by an elementwise pass over `nbytes` of bfloat16 on `device`."""
  x = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), device)
  double = jax.jit(lambda a: a * 2)
  double(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    double(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * nbytes / best


def machine(device) -> dict:
  """The device's f32 and bf16 matmul peaks and its memory bandwidth."""
  n = 2048 if device.platform == "cpu" else 8192
  return dict(f32_peak_flops=matmul_peak_flops(device), bandwidth_bytes_per_s=bandwidth_bytes_per_s(device),
              bf16_peak_flops=matmul_peak_flops(device, n, dtype=jnp.bfloat16), bf16_peak_n=n)


def decode_step_s(engine, params, calls: int) -> float:
  """Median seconds of one decode step with every row busy, the window fixed at WINDOW."""
  prompts = [list(range(3 + i, 3 + i + PROMPT)) for i in range(ROWS)]
  knobs = [SamplingParams(temperature=1.0, max_new_tokens=WINDOW - PROMPT)] * ROWS
  keys = np.stack([np.asarray([0, i], np.uint32) for i in range(ROWS)])
  state = engine.insert(engine.prefill(params, prompts, samplings=knobs, rngs=keys), engine.init_decode_state(),
                        list(range(ROWS)))
  seconds = []
  for _ in range(calls):
    state, _ = engine.make_room(state, {s: 1 for s in range(ROWS)})
    start = time.perf_counter()
    state, out = engine.generate(params, state, WINDOW)
    jax.block_until_ready(out.tokens)
    seconds.append(time.perf_counter() - start)
  return float(np.median(seconds[2:])) / STEPS_PER_CALL


def main() -> dict:
  device = jax.devices()[0]
  config = dataclasses.replace(SMOLLM2_SHAPE, dtype="bfloat16", param_dtype="bfloat16")
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  engine = make_engine(graphdef, config, EngineConfig(
      num_slots=ROWS, max_prompt_length=PROMPT, max_new_tokens=WINDOW - PROMPT, min_prefill_bucket=PROMPT,
      prefill_batch=ROWS, steps_per_sync=STEPS_PER_CALL, short_attention_windows=()), single_device_mesh(device))
  peaks = machine(device)
  step_s = decode_step_s(engine, engine.place_params(params), CALLS)
  weight_bytes = config.param_count() * jnp.dtype(config.weight_dtype).itemsize
  kv_bytes = kv_cache_bytes(config, ROWS, WINDOW)
  memory_s = (weight_bytes + kv_bytes) / peaks["bandwidth_bytes_per_s"]
  compute_s = ROWS * config.flops_per_token(WINDOW) / peaks["bf16_peak_flops"]
  roofline_s = max(memory_s, compute_s)
  return dict(
      backend=jax.default_backend(), device=device.device_kind, rows=ROWS, window=WINDOW,
      f32_peak_tflops=round(peaks["f32_peak_flops"] / 1e12, 3), bf16_peak_tflops=round(peaks["bf16_peak_flops"] / 1e12, 3),
      bandwidth_gb_s=round(peaks["bandwidth_bytes_per_s"] / 1e9, 1),
      ridge_flops_per_byte=round(peaks["bf16_peak_flops"] / peaks["bandwidth_bytes_per_s"], 1),
      decode_weight_mb=round(weight_bytes / 1e6, 1), decode_kv_mb=round(kv_bytes / 1e6, 1),
      decode_step_ms=round(step_s * 1e3, 3), memory_step_ms=round(memory_s * 1e3, 4),
      compute_step_ms=round(compute_s * 1e3, 4), bound="memory" if memory_s >= compute_s else "compute",
      decode_tokens_per_s=round(ROWS / step_s, 1), decode_vs_roofline=round(step_s / roofline_s, 3))


if __name__ == "__main__":
  print(json.dumps(main()))
