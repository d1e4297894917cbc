"""Pure scheduling policies: plain numbers in, a plan out; no devices, no threads, no clocks.

The real pipeline and the simulator call the same functions. PTL curves map a decode batch size to
the per-token latency (seconds per decode step) that the sampler benchmark measures.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

PTLCurve = Mapping[int, float]


def ptl_at(curve: PTLCurve, batch: float) -> float:
  """Per-token latency at `batch`, linear between measured sizes, flat beyond the ends."""
  if not curve:
    raise ValueError("empty latency curve: PTL needs at least one (batch, seconds) point")
  sizes = np.array(sorted(curve), float)
  if np.any(sizes < 1):
    raise ValueError(f"latency curve batch sizes must be >= 1, got {sorted(curve)}")
  return float(np.interp(batch, sizes, [curve[int(s)] for s in sizes]))


def instance_latency(curve: PTLCurve, batch: int, mean_len: float, prompts: int) -> float:
  """StreamRL's model: PTL(batch) * mean_len * ceil(prompts / batch); 0 for no prompts."""
  if prompts == 0:
    return 0.0
  return ptl_at(curve, batch) * mean_len * math.ceil(prompts / batch)


def lpt_order(predicted: Sequence[float]) -> list[int]:
  """Longest-processing-time first: indices by descending predicted length (stable on ties)."""
  return sorted(range(len(predicted)), key=lambda i: -predicted[i])


def fifo_order(pending: Sequence) -> Sequence[int]:
  """An admission policy for `StreamingSampler`: queued requests in arrival order."""
  return range(len(pending))


def longest_first_admission(pending: Sequence) -> list[int]:
  """An admission policy for `StreamingSampler`: queued requests by descending `predicted_length`
  (the ranker's score); requests without a prediction keep their arrival order after the rest."""
  return sorted(range(len(pending)), key=lambda i: (pending[i].predicted_length is None,
                                                    -(pending[i].predicted_length or 0.0), i))


def adaptive_steps(remaining: Sequence[int], *, fresh: int, options: Sequence[int]) -> int:
  """A decode-steps policy for `StreamingSampler`: the steps of an instance's next decode call, one of its
  engine's `options` (ascending: `EngineConfig.step_options`, the last `steps_per_sync`), from its decoding rows'
  `remaining` tokens (each row's max_new_tokens less its tokens so far: an upper bound, a stop token may end it
  sooner) and how many of them were just admitted (`fresh`: their first token not read yet). Requests waiting
  for a slot do not shorten a call: freeing a slot sooner costs a round trip, which on an accelerator is dearer
  than the steps it saves.

  - Every decoding row just admitted: one step, so their first tokens leave after one step (a lone request's time
    to its first token is its prefill and one step).
  - Otherwise the fewest steps that take every row to its limit, at most the most: no call longer than its rows
    need, and no more calls than `steps_per_sync` makes."""
  if not remaining or fresh >= len(remaining):
    return options[0]
  longest = max(1, max(remaining))
  return next((k for k in options if k >= longest), options[-1])


def fixed_steps(remaining: Sequence[int], *, fresh: int, options: Sequence[int]) -> int:
  """A decode-steps policy that always decodes the most steps a call (`steps_per_sync`)."""
  return options[-1]


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """Prompt indices per engine instance in admission order, and each instance's batch size."""

  assignment: tuple[tuple[int, ...], ...]
  batch_sizes: tuple[int, ...]
  long_instances: int = 0  # the first `long_instances` instances serve the long tail

  def __post_init__(self):
    if len(self.assignment) != len(self.batch_sizes):
      raise ValueError("one batch size per instance")


def random_dispatch(num_prompts: int, num_instances: int, max_batch: int, seed: int = 0) -> DispatchPlan:
  """The baseline: prompts shuffled, dealt round-robin, admitted FIFO, every instance at max batch."""
  if num_instances < 1 or max_batch < 1:
    raise ValueError(f"need >= 1 instance and batch, got {num_instances} and {max_batch}")
  order = np.random.default_rng(seed).permutation(num_prompts)
  assignment = tuple(tuple(int(i) for i in order[k::num_instances]) for k in range(num_instances))
  return DispatchPlan(assignment, (max_batch,) * num_instances)


def lpt_assign(indices: Sequence[int], predicted: Sequence[float], instances: int) -> list[list[int]]:
  """Greedy LPT assignment: each prompt (longest first) to the instance with the least predicted work;
  its makespan is within 4/3 of the optimum (Graham)."""
  heap, out = [(0.0, k) for k in range(instances)], [[] for _ in range(instances)]
  for i in sorted(indices, key=lambda i: -predicted[i]):
    load, k = heapq.heappop(heap)
    out[k].append(i)
    heapq.heappush(heap, (load + predicted[i], k))
  return out


def skew_aware_dispatch(predicted: Sequence[float], num_instances: int, max_batch: int, curve: PTLCurve, *,
                        alpha: float = 0.2, long_mean_len: float | None = None,
                        short_mean_len: float | None = None) -> DispatchPlan:
  """StreamRL's skewness-aware dispatch.

  The top `alpha` predicted-longest prompts form the long tail. For every split of instances between
  the two groups and every candidate batch size of the long group, the latency model
  PTL(batch) * mean_len * ceil(prompts / batch) estimates each group's time; the split with the smallest
  maximum wins. Mean lengths default to the P90 (long) and P50 (short) of the predictions; callers
  pass estimates from recent history instead. Inside an instance, admission is longest-first.
  """
  if not 0 < alpha < 1:
    raise ValueError(f"alpha must be in (0, 1), got {alpha}")
  n = len(predicted)
  if num_instances < 2 or n < 2:
    plan = random_dispatch(n, max(num_instances, 1), max_batch)
    return DispatchPlan(tuple(tuple(lpt_order_subset(a, predicted)) for a in plan.assignment), plan.batch_sizes)
  ranked = lpt_order(predicted)
  n_long = max(1, min(n - 1, round(alpha * n)))
  long_ids, short_ids = ranked[:n_long], ranked[n_long:]
  long_len = long_mean_len or float(np.percentile([predicted[i] for i in long_ids], 90))
  short_len = short_mean_len or float(np.percentile([predicted[i] for i in short_ids], 50))
  k_long, long_batch, short_batch = _best_split(curve, num_instances, max_batch, n_long, len(short_ids),
                                                long_len, short_len)
  assignment = lpt_assign(long_ids, predicted, k_long) + lpt_assign(short_ids, predicted, num_instances - k_long)
  batches = (long_batch,) * k_long + (short_batch,) * (num_instances - k_long)
  return DispatchPlan(tuple(tuple(a) for a in assignment), batches, long_instances=k_long)


def _best_split(curve, instances, max_batch, n_long, n_short, long_len, short_len):
  """(long instances, long batch, short batch) minimising max(long time, short time), then their sum,
  over every split of instances and every candidate long-group batch (vectorised)."""
  sizes = np.array(sorted(curve), float)
  ptl = lambda b: np.interp(b, sizes, [curve[int(x)] for x in sizes])  # noqa: E731
  k = np.arange(1, instances)[:, None]
  per_long, per_short = np.ceil(n_long / k), np.ceil(n_short / (instances - k))
  short_batch = np.minimum(max_batch, per_short)
  short_time = np.where(per_short > 0, ptl(short_batch) * short_len * np.ceil(per_short / short_batch), 0.0)
  candidates = np.array([b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= max_batch], float)[None, :]
  long_batch = np.minimum(candidates, per_long)
  long_time = ptl(long_batch) * long_len * np.ceil(per_long / long_batch)
  worst, total = np.maximum(long_time, short_time), long_time + short_time
  flat = np.lexsort((total.ravel(), worst.ravel()))[0]
  row, col = np.unravel_index(flat, worst.shape)
  return int(k[row, 0]), int(long_batch[row, col]), int(short_batch[row, 0])


def lpt_order_subset(indices: Sequence[int], predicted: Sequence[float]) -> list[int]:
  return sorted(indices, key=lambda i: -predicted[i])


def resource_split(total_devices: int, gen_time: Callable[[int], float], train_time: Callable[[int], float], *,
                   sampler_unit: int = 1, trainer_unit: int = 1) -> tuple[int, int]:
  """(sampler, trainer) device counts within `total_devices` minimising max(T_gen, T_train); each side
  gets whole units (e.g. the tensor-parallel size of one engine instance)."""
  if total_devices < sampler_unit + trainer_unit:
    raise ValueError(f"a budget of {total_devices} devices cannot hold one sampler unit ({sampler_unit}) "
                     f"and one trainer unit ({trainer_unit})")
  best = None
  for sampler in range(sampler_unit, total_devices - trainer_unit + 1, sampler_unit):
    trainer = (total_devices - sampler) // trainer_unit * trainer_unit
    if trainer < trainer_unit:
      continue
    score = (max(gen_time(sampler), train_time(trainer)), -(sampler + trainer))
    if best is None or score < best[0]:
      best = (score, sampler, trainer)
  return best[1], best[2]


def elastic_decision(t_gen: float, t_train: float, saved_by_one_more: float, lost_by_one_fewer: float, *,
                     hysteresis: float = 0.05) -> int:
  """+1: add an engine instance (generation lags training by more than one more instance would save);
  -1: remove one (removing it still keeps generation ahead of training); 0: keep. `hysteresis` is a
  fraction of the iteration time that a change must clear, so the decision does not oscillate."""
  margin = hysteresis * max(t_gen, t_train)
  if t_gen - t_train > saved_by_one_more + margin:
    return 1
  if t_train - (t_gen + lost_by_one_fewer) > margin:
    return -1
  return 0


def elastic_target(current: int, gen_s: float, train_s: float, *, low: int, high: int,
                   hysteresis: float = 0.05) -> int:
  """The instance count for the next step, within [low, high], changed by at most one: generation time is
  assumed to scale as 1 / instances, so one more saves gen_s / (n + 1) and one fewer costs gen_s / (n - 1).
  The in-process instances (`SchedulingConfig.elastic`) and `streamrl launch local`'s sampler processes both
  follow this rule."""
  saved = gen_s / (current + 1)
  lost = gen_s / (current - 1) if current > 1 else float("inf")
  change = elastic_decision(gen_s, train_s, saved, lost, hysteresis=hysteresis)
  return int(np.clip(current + change, low, high))
