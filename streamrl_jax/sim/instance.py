"""One engine instance under continuous batching, simulated per finished sample (not per token).

Between two finishes the set of running samples is fixed, so time advances by (steps to the next
finish) x PTL(running); a freed slot admits the next sample in the instance's order, paying its prefill.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np


def simulate_instance(lengths: Sequence[int], max_batch: int, ptl: Callable[[int], float],
                      prefill_s: float = 0.0, start: float = 0.0) -> np.ndarray:
  """Finish times of samples admitted in the given order; `ptl(n)` is the decode step time with n running."""
  if max_batch < 1:
    raise ValueError(f"max_batch must be >= 1, got {max_batch}")
  lengths = np.asarray(lengths, np.int64)
  if np.any(lengths < 1):
    raise ValueError("every output length must be >= 1 token")
  finish = np.zeros(len(lengths))
  running: list[tuple[int, int]] = []  # (decode step at which it finishes, sample index)
  step, now, admitted = 0, start, 0
  while admitted < len(lengths) or running:
    while admitted < len(lengths) and len(running) < max_batch:
      heapq.heappush(running, (step + int(lengths[admitted]), admitted))
      now += prefill_s
      admitted += 1
    next_step = running[0][0]
    now += (next_step - step) * ptl(len(running))
    step = next_step
    while running and running[0][0] == step:
      finish[heapq.heappop(running)[1]] = now
  return finish
