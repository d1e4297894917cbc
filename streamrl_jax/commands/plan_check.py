"""`streamrl plan --topology cpu:N --check`: the plan held to each side run as planned on this machine's devices, each
in a process of its own (`python -m streamrl_jax.commands.plan_check SIDE JSON`, what `check_plan` starts; the
measuring is `planning.measured`'s)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from streamrl_jax.planning.measured import Measured, PlanCheck

SIDE_TIMEOUT_S = 3600


@dataclasses.dataclass(frozen=True)
class SideRun:
  """What a side's process is told: the run as `streamrl plan` read it, and the plan's split and trainer call."""

  side: str  # "trainer" or "sampler"
  config: tuple[str, ...]  # gin files
  sets: tuple[str, ...]  # --set bindings
  model: str
  devices: int  # this machine's CPU as that many devices (the topology's)
  sampler_chips: int
  call_rows: int
  call_length: int
  calls_per_step: int


def check_plan(plan, config: list[str], sets: list[str], progress) -> PlanCheck:
  """Each side of a `cpu:N` plan run and measured in a process of its own, one after the other."""
  notes = plan.trainer.notes
  run = SideRun("trainer", tuple(config), tuple(sets), plan.request.model, plan.topology.devices,
                plan.split["sampler"], notes["call_rows"], notes["call_length"], notes["calls_per_step"])
  progress(f"plan: --check: the trainer's call of {run.call_rows} x {run.call_length} run on this machine ...")
  trainer = _in_process(run)
  progress("plan: --check: a decode step of every slot run on this machine ...")
  sampler = _in_process(dataclasses.replace(run, side="sampler"))
  chip = plan.chip
  return PlanCheck(Measured(plan.trainer.peak_bytes, plan.trainer.step_s(chip)), trainer,
                   Measured(plan.sampler.peak_bytes, plan.sampler.step_s(chip)), sampler)


def _in_process(run: SideRun) -> Measured:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-m", "streamrl_jax.commands.plan_check", json.dumps(dataclasses.asdict(run))],
                        capture_output=True, text=True, env=env, timeout=SIDE_TIMEOUT_S, check=False)
  if done.returncode:
    raise RuntimeError(f"plan --check: the {run.side}'s process failed (exit {done.returncode}): "
                       f"{done.stderr.strip()[-3000:]}")
  return Measured(**json.loads(done.stdout.strip().splitlines()[-1]))


def _measure(run: SideRun) -> Measured:
  from streamrl_jax.commands.host_devices import force_host_devices

  force_host_devices(run.devices)
  import jax

  from streamrl_jax.commands.plan_inputs import planned_run
  from streamrl_jax.planning.measured import measure_sampler, measure_trainer

  setup, model, _, _ = planned_run(list(run.config), list(run.sets), run.model, "cpu")
  devices = jax.devices("cpu")[:run.devices]
  if run.side == "sampler":
    return measure_sampler(setup, model, devices[:run.sampler_chips])
  trainer_devices = devices if setup.shape.spec.shared_mesh else devices[run.sampler_chips:]
  return measure_trainer(setup, model, trainer_devices, run.call_rows, run.call_length, run.calls_per_step)


if __name__ == "__main__":
  said = _measure(SideRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()}))
  print(json.dumps(dataclasses.asdict(said)))
