"""A plan held to a measured run where one can be made (`streamrl plan --topology cpu:N --check`): each side run as
the plan compiled it, on this machine's devices, in a process of its own (a clean memory baseline):

- the trainer (`make_trainer` on the plan's trainer mesh) at the plan's call: one untimed call and update, then
  `ROUNDS` calls timed and an update; its RL step is the plan's calls a step times the median call, plus the update;
- the sampler (one engine instance on the plan's instance mesh): every slot filled, one untimed decode call of one
  step, then `ROUNDS` timed, the median.

A side's memory is its process's resident high-water mark over the timed calls (reset after the compiles) less its
resident memory before its state was made, over its devices. Linux only (`/proc/self`)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.pipeline.trainer.policy import make_trainer
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.planning.trainer_plan import trainer_mesh
from streamrl_jax.sampling.engine_base import planned_requests
from streamrl_jax.sampling.engines import make_engine

ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class Measured:
  """One side as run: bytes a device at its peak, and the seconds of its step (the trainer's RL step, a decode step)."""

  peak_bytes: float
  step_s: float
  call_s: float = 0.0  # the trainer's median call
  apply_s: float = 0.0  # the trainer's update


@dataclasses.dataclass(frozen=True)
class PlanCheck:
  """The plan's figures over the measured ones: a ratio of 1 is a plan that saw it exactly; a roofline is a lower
  bound, so a step's ratio falls below 1 by what the machine's non-product work costs."""

  planned_trainer: Measured
  measured_trainer: Measured
  planned_sampler: Measured
  measured_sampler: Measured

  def figures(self) -> dict:
    out = {}
    for side in ("trainer", "sampler"):
      planned, measured = getattr(self, f"planned_{side}"), getattr(self, f"measured_{side}")
      step = "trainer_step" if side == "trainer" else "decode_step"
      out |= {f"{side}_peak_ratio": round(planned.peak_bytes / measured.peak_bytes, 3),
              f"{side}_peak_error": round(abs(planned.peak_bytes / measured.peak_bytes - 1), 3),
              f"{step}_ratio": round(planned.step_s / measured.step_s, 3),
              f"{step}_error": round(abs(planned.step_s / measured.step_s - 1), 3),
              f"planned_{side}": dataclasses.asdict(planned), f"measured_{side}": dataclasses.asdict(measured)}
    return out


def measure_trainer(setup: PlanSetup, model: ModelConfig, devices: list, rows: int, width: int,
                    calls: int) -> Measured:
  """The run's trainer on `devices` at a call of `rows` x `width` packed tokens (two segments a row)."""
  mesh = trainer_mesh(setup, devices)
  graphdef, params = nnx.split(Transformer(model, rngs=nnx.Rngs(0)))
  trainer, trained = make_trainer(setup.trainer, setup.shape, setup.mesh.expert_axis, graphdef, params, mesh, False)
  before = resident_bytes()
  state = trainer.init_state(trained)
  batch = _packed_call(rows, width, model.vocab_size)
  state = trainer.accumulate(state, batch)
  state, _ = trainer.apply(state)  # compiled and run once
  reset_high_water()
  seconds = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    state = trainer.accumulate(state, batch)
    jax.block_until_ready(state.sums)
    seconds.append(time.perf_counter() - start)
  start = time.perf_counter()
  state, _ = trainer.apply(state)
  jax.block_until_ready(state)
  apply_s = time.perf_counter() - start
  call_s = statistics.median(seconds)
  return Measured((high_water_bytes() - before) / len(devices), calls * call_s + apply_s, call_s, apply_s)


def _packed_call(rows: int, width: int, vocab: int) -> dict:
  rng = np.random.default_rng(0)
  half = width // 2
  return dict(tokens=rng.integers(0, vocab, (rows, width)).astype(np.int32), valid=np.ones((rows, width), bool),
              segment_ids=np.repeat(np.arange(1, 3), half)[None].repeat(rows, 0).astype(np.int32),
              loss_mask=(np.arange(width)[None].repeat(rows, 0) % half) >= half // 2,
              advantages=rng.normal(size=(rows, width)).astype(np.float32),
              logprobs=-rng.random((rows, width)).astype(np.float32))


def measure_sampler(setup: PlanSetup, model: ModelConfig, devices: list) -> Measured:
  """One engine instance on the first `MeshConfig.sampler_tensor_parallel` of `devices`, every slot filled."""
  tensor = setup.mesh.sampler_tensor_parallel
  mesh = mesh_from_devices(devices[:tensor], MeshShape(1, 1, tensor))
  graphdef, params = nnx.split(Transformer(model, rngs=nnx.Rngs(0)))
  before = resident_bytes()
  engine = make_engine(graphdef, model, setup.engine, mesh)
  params = engine.place_params(params)
  state = engine.init_decode_state()
  prompts, samplings, rngs = planned_requests(setup.engine, model.vocab_size)
  for first in range(0, setup.engine.num_slots, len(prompts)):
    slots = list(range(first, min(first + len(prompts), setup.engine.num_slots)))
    prefix = engine.prefill(params, prompts[:len(slots)], samplings=samplings[:len(slots)], rngs=rngs[:len(slots)])
    state = engine.insert(prefix, state, slots)
  state, out = engine.generate(params, state, steps=1)  # compiled
  reset_high_water()
  seconds = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    state, out = engine.generate(params, state, steps=1)
    jax.block_until_ready(out.tokens)
    seconds.append(time.perf_counter() - start)
  return Measured((high_water_bytes() - before) / tensor, statistics.median(seconds))


def resident_bytes() -> int:
  """This process's resident memory now."""
  return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_bytes() -> int:
  """This process's resident high-water mark (VmHWM) since `reset_high_water`."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) * 1024
  raise OSError("/proc/self/status has no VmHWM line")


def reset_high_water() -> None:
  Path("/proc/self/clear_refs").write_text("5")


def can_measure() -> str:
  """'' when this machine can measure a side, else why not."""
  if not Path("/proc/self/clear_refs").exists():
    return "--check reads a process's memory from /proc/self (Linux)"
  return ""
