"""The per-token latency (PTL) curve of an engine: seconds per decode step by slot count, every slot busy.

The latency model of skew-aware dispatch (`SchedulingConfig.ptl_curve`) needs this curve for the model and
devices at hand; `measure_ptl_curve` times it on real engines (one compile per slot count).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from streamrl_jax.sampling.streaming_sampler import StreamingSampler
from streamrl_jax.sampling.engine import DecodeEngine
from streamrl_jax.types import SamplingParams


def measure_ptl_curve(engine_for: Callable[[int], DecodeEngine], params, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                      *, steps: int = 16, prompt: Sequence[int] = (5,) * 8) -> dict[int, float]:
  """{slots: seconds per decode step} with every slot of `engine_for(slots)` generating; the first two
  steps (compiles, prefills) are not timed. Requests run to the engine's max_new_tokens, which must leave
  room for `steps + 2` tokens."""
  curve = {}
  for size in sizes:
    engine = engine_for(size)
    if engine.config.max_new_tokens < steps + 2:
      raise ValueError(f"EngineConfig.max_new_tokens={engine.config.max_new_tokens} is too short to time "
                       f"{steps} decode steps")
    sampler = StreamingSampler([engine], params)
    for _ in range(size):
      sampler.submit(list(prompt), SamplingParams(max_new_tokens=engine.config.max_new_tokens))
    sampler.step()
    sampler.step()
    start = time.perf_counter()
    for _ in range(steps):
      sampler.step()
    curve[size] = (time.perf_counter() - start) / steps
  return curve
