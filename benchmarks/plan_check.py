"""`streamrl plan` held to a measured run where one can be made: SmolLM2-135M-Instruct with configs/smollm2_cpu.gin on
this CPU's 8 host devices (`--topology cpu:8`, the sampler on the first half, the trainer on the rest), the plan made
and each side then run in a process of its own, as the plan compiled it:

- the trainer (`make_trainer` on its 4-device mesh, the run's packed call of the plan's rows, `MicroBatcher`-shaped):
  one untimed call and update, then `ROUNDS` calls and an update timed; its memory is the process's resident high-water
  mark less the resident memory before its state was made, over its devices;
- the sampler (one engine instance, the run's slots and lengths): every slot filled, then decode calls of one step
  timed the same way.

`trainer_peak_ratio` and `sampler_peak_ratio` are the plan's per-device peak over the measured one, `*_peak_error`
their distance from 1 (goal: <= 0.15); `trainer_step_ratio` the plan's roofline RL step over the measured one (calls a
step times the median call, plus the update), `decode_step_ratio` likewise, `*_step_error` their distance from 1 (goal:
<= 0.3); a roofline is a lower bound, so those ratios fall below 1 by what the machine's non-product work costs. A
quick run (`STREAMRL_BENCH_QUICK=1`) is the same: the plan's sizes are the run's. Prints one JSON object as its last
line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_cpu.gin"
DEVICES = 8
ROUNDS = 5


def _setup():
  """(plan setup, model config) of the run, on this process's CPU backend."""
  from streamrl_jax import gin_config
  from streamrl_jax.models.catalog import resolve_model
  from streamrl_jax.models.hf_io import read_hf_config
  from streamrl_jax.pipeline.parts import plan_setup

  gin_config.parse(gin_config.run_files([str(CONFIG)]), [])
  config, job = gin_config.build_run()
  dtype = job.compute_choice().dtype
  return plan_setup(config.resolved(dtype)), read_hf_config(resolve_model(job.model), dtype=dtype)


def make() -> dict:
  """The plan's figures (this process)."""
  from streamrl_jax.planning.plan import PlanRequest, make_plan

  setup, model = _setup()
  half = DEVICES // 2
  plan = make_plan(PlanRequest(str(CONFIG), f"cpu:{DEVICES}", sampler_chips=half), setup, model, "catalog")
  return dict(trainer_peak=plan.trainer.peak_bytes, sampler_peak=plan.sampler.peak_bytes,
              trainer_step_s=plan.trainer.step_s(plan.chip), decode_step_s=plan.sampler.step_s(plan.chip),
              notes=plan.trainer.notes, chip=plan.chip.name, peak_flops=plan.chip.peak_flops * DEVICES,
              bandwidth=plan.chip.hbm_bytes_per_s * DEVICES, trainer_fits=plan.trainer_hbm_frac)


def trainer(rows: int, width: int, calls: int) -> dict:
  """The run's trainer on devices 4..7 at the plan's call: (bytes a device, seconds an RL step)."""
  import jax
  import numpy as np
  from flax import nnx

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.models import Transformer
  from streamrl_jax.pipeline.trainer.policy import make_trainer

  setup, model = _setup()
  devices = jax.devices()[DEVICES // 2:]
  mesh = mesh_from_devices(devices, MeshShape(1, len(devices), 1))
  graphdef, params = nnx.split(Transformer(model, rngs=nnx.Rngs(0)))
  trainer_, trained = make_trainer(setup.trainer, setup.shape, setup.mesh.expert_axis, graphdef, params, mesh, False)
  before = _resident()
  state = trainer_.init_state(trained)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, model.vocab_size, (rows, width)).astype(np.int32)
  segments = np.repeat(np.arange(1, 3), width // 2)[None].repeat(rows, 0).astype(np.int32)
  batch = dict(tokens=tokens, valid=np.ones((rows, width), bool), segment_ids=segments,
               loss_mask=(np.arange(width)[None] % (width // 2)) >= 40, advantages=rng.normal(size=(rows, width)),
               logprobs=-rng.random((rows, width)).astype(np.float32))
  state = trainer_.accumulate(state, batch)
  state, _ = trainer_.apply(state)  # compiled and run once
  _reset_high_water()  # the compiles' own memory apart
  seconds = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    state = trainer_.accumulate(state, batch)
    jax.block_until_ready(state.sums)
    seconds.append(time.perf_counter() - start)
  start = time.perf_counter()
  state, _ = trainer_.apply(state)
  apply_s = time.perf_counter() - start
  return dict(peak=(_high_water() - before) / len(devices), step_s=calls * statistics.median(seconds) + apply_s,
              call_s=statistics.median(seconds), apply_s=apply_s)


def sampler() -> dict:
  """One engine instance on device 0 with every slot filled: (bytes a device, seconds a decode step)."""
  import jax
  from flax import nnx

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.models import Transformer
  from streamrl_jax.sampling.engine_base import planned_requests
  from streamrl_jax.sampling.engines import make_engine

  setup, model = _setup()
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  graphdef, params = nnx.split(Transformer(model, rngs=nnx.Rngs(0)))
  before = _resident()
  engine = make_engine(graphdef, model, setup.engine, mesh)
  params = engine.place_params(params)
  state = engine.init_decode_state()
  prompts, samplings, rngs = planned_requests(setup.engine, model.vocab_size)
  for first in range(0, setup.engine.num_slots, len(prompts)):
    prefix = engine.prefill(params, prompts, samplings=samplings, rngs=rngs)
    state = engine.insert(prefix, state, list(range(first, first + len(prompts))))
  state, out = engine.generate(params, state, steps=1)  # compiled
  _reset_high_water()
  seconds = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    state, out = engine.generate(params, state, steps=1)
    jax.block_until_ready(out.tokens)
    seconds.append(time.perf_counter() - start)
  return dict(peak=_high_water() - before, step_s=statistics.median(seconds))


def _resident() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
  """VmHWM: the resident high-water mark since `_reset_high_water`."""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_high_water() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _in_process(role: str, *args) -> dict:
  """`role`'s figures from a process of its own (a clean memory baseline), forced to `DEVICES` host devices."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, __file__, role, *map(str, args)], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=3600, check=False)
  if done.returncode:
    raise RuntimeError(f"{role}: {done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
  plan = _in_process("plan")
  notes = plan["notes"]
  measured_trainer = _in_process("trainer", notes["call_rows"], notes["call_length"], notes["calls_per_step"])
  measured_sampler = _in_process("sampler")
  print(json.dumps(dict(
      cpu=plan["chip"], topology=f"cpu:{DEVICES}", model="smollm2-135m-instruct", config=str(CONFIG.relative_to(ROOT)),
      call=f"{notes['call_rows']} x {notes['call_length']}", calls_per_step=notes["calls_per_step"],
      plan_trainer_peak_bytes=plan["trainer_peak"], measured_trainer_peak_bytes=measured_trainer["peak"],
      trainer_peak_ratio=round(plan["trainer_peak"] / measured_trainer["peak"], 3),
      trainer_peak_error=round(abs(plan["trainer_peak"] / measured_trainer["peak"] - 1), 3),
      sampler_peak_error=round(abs(plan["sampler_peak"] / measured_sampler["peak"] - 1), 3),
      trainer_step_error=round(abs(plan["trainer_step_s"] / measured_trainer["step_s"] - 1), 3),
      decode_step_error=round(abs(plan["decode_step_s"] / measured_sampler["step_s"] - 1), 3),
      plan_sampler_peak_bytes=plan["sampler_peak"], measured_sampler_peak_bytes=measured_sampler["peak"],
      sampler_peak_ratio=round(plan["sampler_peak"] / measured_sampler["peak"], 3),
      plan_trainer_step_s=plan["trainer_step_s"], measured_trainer_step_s=measured_trainer["step_s"],
      measured_call_s=measured_trainer["call_s"], measured_apply_s=measured_trainer["apply_s"],
      trainer_step_ratio=round(plan["trainer_step_s"] / measured_trainer["step_s"], 3),
      plan_decode_step_s=plan["decode_step_s"], measured_decode_step_s=measured_sampler["step_s"],
      decode_step_ratio=round(plan["decode_step_s"] / measured_sampler["step_s"], 3),
      machine_peak_flops=plan["peak_flops"], machine_bandwidth=plan["bandwidth"])))


if __name__ == "__main__":
  if len(sys.argv) > 1:
    role, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    print(json.dumps({"plan": make, "trainer": trainer, "sampler": sampler}[role](*args)))
  else:
    main()
