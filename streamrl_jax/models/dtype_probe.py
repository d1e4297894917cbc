"""What `compute_dtype='auto'` means on this machine, decided by measurement.

On an accelerator 'auto' is bfloat16 (its matrix units run it several times faster than float32). On a CPU it depends
on the chip: with bfloat16 matrix units (Intel's AMX) bfloat16 products into float32 run 4-5x faster than float32's;
without them (AVX2, AVX-512 without BF16) they run slower. No instruction-set flag says which by itself, so a probe
times the model's own products, as the trainer computes them (`layers.tokens_matmul`: a forward product and the two
of its backward pass, for one decoder layer's weights and the LM head, weighted by the layer count) in float32 and
in bfloat16 into float32, and picks the faster. bfloat16 must win by `MARGIN`: a tie keeps float32's numerics.

The result is cached per machine (host name, CPU model, core count) and jax version in `$STREAMRL_CACHE` (default
`~/.cache/streamrl_jax`, as the model catalog), so a machine pays the probe (a few seconds) once per model shape.
`STREAMRL_PROBE_DTYPE=float32|bfloat16` forces the probe's answer (tests; a benchmark measuring the other dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from pathlib import Path

from streamrl_jax.models.config import ACCELERATED_BACKENDS, COMPUTE_DTYPES, ModelConfig

PROBE_ENV = "STREAMRL_PROBE_DTYPE"
PROBED = ("float32", "bfloat16")
PROBE_ROWS = 256  # tokens a timed product multiplies: a packed training row's order of size
MARGIN = 0.95  # bfloat16 is chosen where its products take under this fraction of float32's time
REPEATS = 3  # timed calls per dtype after one that compiles; the best is kept
# A model whose products over PROBE_ROWS tokens come to fewer FLOPs than this (the demo decoder's: 0.03 GFLOP, a
# millisecond) computes in float32 unprobed: its timings are call overhead, noise either way, and its speed does not
# depend on the dtype
MIN_PROBED_FLOPS = 1e9
CACHE_FILE = "compute_dtype_probe.json"


@dataclasses.dataclass(frozen=True)
class ProductShapes:
  """The products a model's training step multiplies: `rows` tokens by each (in, out) weight of one decoder layer,
  `layers` times, and by the LM head once."""

  rows: int
  layer: tuple[tuple[int, int], ...]
  layers: int
  head: tuple[int, int]

  @classmethod
  def of(cls, config: ModelConfig, rows: int = PROBE_ROWS) -> ProductShapes:
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    width = config.moe_intermediate_size * max(config.experts_per_token, 1) if config.num_experts else \
        config.intermediate_size
    layer = ((hidden, heads + 2 * kv), (heads, hidden), (hidden, 2 * width), (width, hidden))
    return cls(rows, layer, config.num_layers, (hidden, config.vocab_size))

  def flops(self) -> float:
    """A training step's products over these shapes: the forward one and the two of the backward pass."""
    per_layer = sum(i * o for i, o in self.layer)
    return 3 * 2 * self.rows * (self.layers * per_layer + self.head[0] * self.head[1])

  def key(self) -> str:
    return f"rows {self.rows}, layer {list(map(list, self.layer))} x {self.layers}, head {list(self.head)}"


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
  """The dtype a run computes in and why; with the probe's figures (FLOP/s at the model's shapes) where it ran."""

  dtype: str
  reason: str
  float32_flops: float = 0.0
  bfloat16_flops: float = 0.0

  def as_dict(self) -> dict:
    return {"dtype": self.dtype, "reason": self.reason,
            **({"float32_gflops_at_model_shapes": round(self.float32_flops / 1e9, 1),
                "bfloat16_gflops_at_model_shapes": round(self.bfloat16_flops / 1e9, 1)} if self.float32_flops else {})}

  def flops(self) -> float:
    """The probe's FLOP/s in the chosen dtype: what the model's shapes reach on this machine (0: not probed)."""
    return self.bfloat16_flops if self.dtype == "bfloat16" else self.float32_flops


def choose_compute_dtype(choice: str, shapes: ProductShapes | None, backend: str | None = None,
                         cache_dir: Path | None = None) -> DtypeChoice:
  """What `choice` ('auto', 'float32' or 'bfloat16') means for a model of `shapes` (needed for 'auto' on a CPU) on
  `backend` (default: jax's)."""
  if choice not in COMPUTE_DTYPES:
    raise ValueError(f"compute dtype {choice!r}; known: {list(COMPUTE_DTYPES)}")
  if choice != "auto":
    return DtypeChoice(choice, "named by the config")
  if backend is None:
    import jax

    backend = jax.default_backend()
  if backend in ACCELERATED_BACKENDS:
    return DtypeChoice("bfloat16", f"'auto' on {backend}: bfloat16, which its matrix units run fastest")
  if forced := os.environ.get(PROBE_ENV):
    if forced not in PROBED:
      raise ValueError(f"{PROBE_ENV}={forced!r}; known: {list(PROBED)}")
    return DtypeChoice(forced, f"'auto' on this CPU: {forced}, forced by {PROBE_ENV}")
  if shapes is None:
    raise ValueError("compute dtype 'auto' on a CPU is decided at the model's product shapes: pass them")
  if shapes.flops() < MIN_PROBED_FLOPS:
    return DtypeChoice("float32", f"'auto' on this CPU: float32; the model's products ({shapes.flops() / 1e9:.2f} "
                                  f"GFLOP a probe) are too small for a dtype to change its speed")
  return _probed(shapes, cache_dir)


@functools.cache
def _probed(shapes: ProductShapes, cache_dir: Path | None) -> DtypeChoice:
  path = (cache_dir or _cache_dir()) / CACHE_FILE
  key = f"{machine()} | jax {_jax_version()} | {shapes.key()}"
  cached = _read_cache(path)
  if key in cached:
    f32, bf16, how = cached[key]["float32_flops"], cached[key]["bfloat16_flops"], "cached"
  else:
    f32, bf16 = measure(shapes)
    cached[key] = {"float32_flops": f32, "bfloat16_flops": bf16, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write_cache(path, cached)
    how = "measured now"
  dtype = "bfloat16" if bf16 * MARGIN > f32 else "float32"
  reason = (f"'auto' on this CPU: {dtype}; the model's products ({how}, {path}) run at {f32 / 1e9:.0f} GFLOP/s in "
            f"float32 and {bf16 / 1e9:.0f} in bfloat16 into float32 (bfloat16 chosen where it is over "
            f"{1 / MARGIN:.2f}x faster)")
  return DtypeChoice(dtype, reason, f32, bf16)


def measure(shapes: ProductShapes, repeats: int = REPEATS, device=None) -> tuple[float, float]:
  """(float32, bfloat16-into-float32) FLOP/s of a training step's products over `shapes` on `device` (default: jax's
  first): each dtype's best of `repeats` timed calls, one layer's products and the head's timed apart and summed as
  the model weighs them."""
  return tuple(_dtype_flops(shapes, dtype, repeats, device) for dtype in PROBED)


def _dtype_flops(shapes: ProductShapes, dtype: str, repeats: int, device) -> float:
  import jax
  import jax.numpy as jnp

  from streamrl_jax.models.layers import tokens_matmul

  device = device or jax.devices()[0]
  keys = iter(jax.random.split(jax.random.key(0), 2 * len(shapes.layer) + 2))

  def operands(dims):
    x = jax.random.normal(next(keys), (shapes.rows, dims[0]), jnp.float32).astype(dtype)
    return jax.device_put((x, jax.random.normal(next(keys), dims, jnp.float32) * 0.02), device)

  def step(xs, ws):  # every product's forward pass and both gradients, as the trainer's backward pass takes them
    loss = lambda xs, ws: sum(jnp.sum(tokens_matmul(x, w).astype(jnp.float32)) for x, w in zip(xs, ws))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))(xs, ws)

  timed = jax.jit(step)
  seconds = []
  for dims_list in (shapes.layer, (shapes.head,)):
    xs, ws = zip(*(operands(d) for d in dims_list))
    jax.block_until_ready(timed(xs, ws))
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(timed(xs, ws))
      best = min(best, time.perf_counter() - start)
    seconds.append(best)
  return shapes.flops() / (shapes.layers * seconds[0] + seconds[1])


def machine() -> str:
  """This machine as the cache knows it: host name, CPU model and core count."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as info:
      model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
  except OSError:
    pass
  return f"{platform.node()} | {model} | {os.cpu_count()} cores"


def _jax_version() -> str:
  import jax

  return jax.__version__


def _cache_dir() -> Path:
  from streamrl_jax.models.catalog import cache_root

  return cache_root()


def _read_cache(path: Path) -> dict:
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):  # none yet, or a torn or foreign file: measured again and rewritten
    return {}
  return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict) -> None:
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=1))
    scratch.replace(path)  # atomic: a process starting beside this one reads the old file or the new one
  except OSError:  # a read-only home: the probe runs again next time, nothing else changes
    pass
