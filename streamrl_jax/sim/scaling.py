"""The `distflow-scaling` preset: samples per second per trainer device, from 8 to 1,024 trainer devices, for the
trainer's two data-plane designs (`sim.dataplane`), a 7B and a 72B model. Analytic: one steady-state iteration a
point, in seconds, with no per-sample simulation.

Weak scaling: a point of D trainer devices trains the base preset's samples per trainer device times D, in as many
micro-batches as the base preset has, so an ideal system keeps the throughput per device constant. Samplers grow with
the trainer at the base preset's ratio and keep pace with it: generation takes as long as the training compute (the
balanced split), so the sampler side is fixed per trainer device. Async, staleness 1:

  iteration    = max(trainer path, process 0, version loop)
  trainer path = compute + optimizer step + shard broadcast + gradient reduction + the version to the hosts
  process 0    = its busiest resource (NIC in, NIC out, decode and check), which its server spends beside training
  version loop = (generation + the last micro-batch and the step after it + publishing) / (1 + staleness)

Output lengths enter through their mean and, for the broadcast's padding, the expected longest row of a micro-batch
of n rows, read as the 1 - 1/(n + 1) quantile of a seeded draw (monotone in n).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from streamrl_jax.sim.dataplane import (DESIGNS, gather_seconds, gradient_seconds, leader_seconds, processes,
                                        shard_broadcast_seconds)
from streamrl_jax.sim.pipeline import SimConfig, sync_seconds, train_seconds, weight_bytes

SCALING_DEVICES = tuple(2 ** k for k in range(3, 11))  # 8 .. 1,024 trainer devices
BEYOND_DEVICES = tuple(2 ** k for k in range(11, 18))  # 2,048 .. 131,072: where the central design stops scaling
LENGTH_DRAWS = 1 << 16  # output lengths drawn for the mean and the quantiles


def at_devices(config: SimConfig, devices: int) -> SimConfig:
  """`config` grown (or shrunk) to `devices` trainer devices: its samples and samplers per trainer device kept, its
  micro-batches per iteration kept."""
  per_device = config.batch.global_batch / config.training_devices
  shards = math.ceil(config.batch.global_batch / config.batch.micro_batch)
  tp = config.tensor_parallel
  samplers = max(tp, round(config.sampler_devices / config.training_devices * devices / tp) * tp)
  samples = max(1, round(per_device * devices))
  batch = dataclasses.replace(config.batch, global_batch=samples, micro_batch=math.ceil(samples / shards))
  return dataclasses.replace(config, total_devices=devices + samplers, sampler_devices=samplers, batch=batch)


def length_draws(config: SimConfig, seed: int = 0) -> np.ndarray:
  """A seeded, sorted draw of `config`'s output lengths."""
  return np.sort(config.lengths.sample(np.random.default_rng(seed), LENGTH_DRAWS))


def iteration_parts(config: SimConfig, draws: np.ndarray, loop: bool = True) -> dict[str, float]:
  """Seconds of each part of one steady-state iteration of `config` (its trainer devices and batch): the trainer's
  path, process 0's load beside it and (with `loop`) the version loop."""
  devices, plane, batch = config.training_devices, config.data_plane, config.batch
  samples, prompt = batch.global_batch, batch.prompt_len
  tokens = samples * (float(draws.mean()) + prompt)
  shards, rows = math.ceil(samples / batch.micro_batch), min(batch.micro_batch, samples)
  longest = float(np.quantile(draws, 1 - 1 / (rows + 1))) + prompt
  compute = train_seconds(config, tokens, devices)
  broadcast = shard_broadcast_seconds(plane, samples * longest, shards, devices)
  step = (config.trainer.optimizer_step_s + gradient_seconds(plane, config.model.params_b * 1e9, devices)
          + gather_seconds(plane, weight_bytes(config), devices))
  parts = {"trainer_path": compute + broadcast + step, "compute": compute, "broadcast": broadcast,
           "step_and_version_to_hosts": step,
           "process_0": leader_seconds(plane, samples, tokens, weight_bytes(config), devices)}
  if loop:
    tail = (compute + broadcast) / shards + step
    parts["version_loop"] = (compute + tail + sync_seconds(config)) / (1 + config.staleness)
  return parts


BOUNDS = ("trainer_path", "process_0", "version_loop")


def iteration_seconds(parts: dict[str, float]) -> tuple[float, str]:
  """The iteration's seconds and what bounds it."""
  bound = max((b for b in BOUNDS if b in parts), key=lambda b: parts[b])
  return parts[bound], bound


def sweep(config: SimConfig, devices=SCALING_DEVICES, seed: int = 0, loop: bool = True) -> dict:
  """Per-device throughput of `config`'s design at each trainer device count, normalised to the first (`loop`: with
  the version loop)."""
  draws = length_draws(config, seed)
  rows = []
  for d in devices:
    scaled = at_devices(config, d)
    parts = iteration_parts(scaled, draws, loop)
    seconds, bound = iteration_seconds(parts)
    rows.append((scaled.batch.global_batch / seconds / d, seconds, bound, parts))
  base = rows[0][0]
  return {"samples_per_s_per_device": [round(r[0], 6) for r in rows],
          "normalized": [round(r[0] / base, 4) for r in rows], "iteration_s": [round(r[1], 3) for r in rows],
          "bound": [r[2] for r in rows], "parts_s": [{k: round(v, 4) for k, v in r[3].items()} for r in rows]}


def first_devices(config: SimConfig, test, seed: int = 0, max_devices: int = 1 << 24) -> int | None:
  """The fewest trainer devices (whole hosts) at which `test(parts, one_host_parts)` holds, the version loop left out
  (it would need a tree of millions of samplers); None if not by `max_devices`. Once `test` holds it must keep
  holding as devices grow."""
  draws, host = length_draws(config, seed), config.data_plane.devices_per_host
  base = iteration_parts(at_devices(config, host), draws, loop=False)
  holds = lambda hosts: test(iteration_parts(at_devices(config, hosts * host), draws, loop=False), base)  # noqa: E731
  if holds(1):
    return host
  lo, hi = 1, 2
  while not holds(hi):
    if hi * host >= max_devices:
      return None
    lo, hi = hi, hi * 2
  while hi - lo > 1:  # holds(hi), not holds(lo)
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if holds(mid) else (mid, hi)
  return hi * host


def process_0_bound(parts: dict, base: dict) -> bool:
  """Process 0's own load is at least the trainer's path."""
  return parts["process_0"] >= parts["trainer_path"]


def half_throughput(parts: dict, base: dict) -> bool:
  """The iteration takes at least twice the one-host iteration's (per-device throughput halved)."""
  return iteration_seconds(parts)[0] >= 2 * iteration_seconds(base)[0]


def scaling_results(bases: dict[str, SimConfig], seed: int = 0) -> dict:
  """The sweep of each base config (by model) under both designs, with the contract's summary figures."""
  models = {}
  for key, config in bases.items():
    designs = {d: dataclasses.replace(config, data_plane=dataclasses.replace(config.data_plane, design=d))
               for d in DESIGNS}
    runs = {d: sweep(c, seed=seed) for d, c in designs.items()}
    beyond = {d: sweep(c, (SCALING_DEVICES[0], *BEYOND_DEVICES), seed, loop=False)["normalized"][1:]
              for d, c in designs.items()}
    per_device = config.batch.global_batch / config.training_devices
    models[key] = {"model": config.model.name, "samples_per_device": per_device,
                   "micro_batches": math.ceil(config.batch.global_batch / config.batch.micro_batch),
                   "processes": [processes(config.data_plane, d) for d in SCALING_DEVICES], **runs,
                   "beyond": {"devices": list(BEYOND_DEVICES), "version_loop": "left out", **beyond}}
  last = SCALING_DEVICES[-1]
  central = {k: dataclasses.replace(c, data_plane=dataclasses.replace(c.data_plane, design="central"))
             for k, c in bases.items()}
  by_model = {d: {k: m[d]["normalized"][-1] for k, m in models.items()} for d in DESIGNS}
  return {
      "devices": list(SCALING_DEVICES), "mode": next(iter(bases.values())).mode,
      f"per_process_scaling_{last}": min(by_model["per_process"].values()),
      f"central_scaling_{last}": min(by_model["central"].values()),
      f"per_process_scaling_{last}_by_model": by_model["per_process"],
      f"central_scaling_{last}_by_model": by_model["central"],
      "central_saturation_devices_by_model": {k: first_devices(c, process_0_bound, seed)
                                              for k, c in central.items()},
      "central_half_throughput_devices_by_model": {k: first_devices(c, half_throughput, seed)
                                                   for k, c in central.items()},
      "models": models,
      "data_plane": dataclasses.asdict(next(iter(bases.values())).data_plane) | {"design": list(DESIGNS)},
  }
