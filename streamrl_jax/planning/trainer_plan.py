"""The trainer's side of a plan: the trainer the run builds (`pipeline.trainer.policy.make_trainer`: the policy, its
KL reference or LoRA base, its remat and attention) on its own mesh of the topology's chips, its state as shapes, its
full call (the packed rows `MicroBatcher` sends, sized by the chip's memory as the run sizes them) and its optimizer
step compiled for that chip; and the RL step's work from them."""

from __future__ import annotations

import math

import jax
import numpy as np

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, abstract_model
from streamrl_jax.models.device_memory import device_bytes
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.pipeline.trainer.policy import make_trainer, packing
from streamrl_jax.planning.chips import Chip
from streamrl_jax.planning.compiled import program_cost
from streamrl_jax.planning.roofline import TrainerShape, optimizer_step, trainer_call
from streamrl_jax.planning.sides import SidePlan, peaks_of
from streamrl_jax.training.host_batch import bucket
from streamrl_jax.training.packing import call_rows, packed_length

PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def shapes(tree):
  """Every array (or shape) of `tree` as a `jax.ShapeDtypeStruct` without a sharding."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def trainer_mesh(setup: PlanSetup, devices: list):
  tensor = setup.mesh.trainer_tensor_parallel
  if len(devices) % tensor:
    raise ValueError(f"MeshConfig.trainer_tensor_parallel={tensor} does not divide the plan's {len(devices)} trainer "
                     "chips")
  return mesh_from_devices(devices, MeshShape(1, len(devices) // tensor, tensor))


def plan_trainer(setup: PlanSetup, model: ModelConfig, devices: list, chip: Chip,
                 new_tokens: float) -> SidePlan:
  """The trainer on `devices` (chips of `chip`), its samples `new_tokens` long at the median."""
  mesh = trainer_mesh(setup, devices)
  graphdef, abstract = abstract_model(model)
  trainer, trained = make_trainer(setup.trainer, setup.shape, setup.mesh.expert_axis, graphdef, shapes(abstract),
                                  mesh, resume=False)
  state = trainer.abstract_state(shapes(trained))
  rows, width, packed, budget_refused = _call_shape(setup, trainer, graphdef, shapes(abstract), mesh, chip)
  call = lambda n: program_cost("trainer.accumulate", trainer.lowered_accumulate(  # noqa: E731
      state, trainer.call_shapes(n, width, packed)))
  programs = {"accumulate": call(rows), "apply": program_cost("trainer.apply", trainer.lowered_apply(state))}
  held = {"weights": device_bytes(state.params), "optimizer": device_bytes(state.opt_state),
          "gradient": device_bytes(state.grad_sum), "frozen": device_bytes(trainer.frozen),
          # the version published to the samplers: an on-device copy in their precision, while it is sent
          "published": int(model.param_count() * PRECISION_BYTES[setup.precision.precision] / len(devices))}
  arguments = {"accumulate": {"weights", "gradient", "frozen"}, "apply": {"weights", "optimizer", "gradient"}}
  smallest = trainer.packed_row_quantum if packed else trainer.min_rows
  one_row = None
  if programs["accumulate"].refused and rows > smallest:  # what a call of one row a batch shard would need
    smaller = call(smallest)
    one_row = dict(rows=smallest, chunk_tokens=smallest * width, refused=smaller.refused,
                   peak_bytes=peaks_of({"accumulate": smaller}, held, arguments)["accumulate"])
  lora = setup.trainer.lora.enabled
  shape = TrainerShape(width, trainer.packed_row_quantum, mesh.shape["fsdp"], mesh.shape["tensor"],
                       setup.trainer.remat, trainer.has_reference, lora, np.dtype(model.compute_dtype).itemsize)
  step_rows = _step_rows(setup, width, packed, new_tokens)
  calls = math.ceil(step_rows / rows)
  adapters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trained)) if lora else 0
  step = trainer_call(model, rows * width, len(devices), shape) * calls + optimizer_step(model, len(devices), adapters)
  notes = dict(call_rows=rows, call_length=width, packed=packed, batch_shards=trainer.packed_row_quantum,
               calls_per_step=calls, rows_per_step=step_rows,
               remat=setup.trainer.remat, attention=setup.trainer.attention, reference=trainer.has_reference,
               lora=lora, call=trainer_call(model, rows * width, len(devices), shape).seconds(chip), one_row=one_row,
               budget_refused=budget_refused,
               apply=optimizer_step(model, len(devices), adapters).seconds(chip))
  return SidePlan("trainer", dict(mesh.shape), tuple(programs.values()), held,
                  peaks_of(programs, held, arguments), step, notes)


def _call_shape(setup: PlanSetup, trainer, graphdef, params, mesh, chip: Chip) -> tuple[int, int, bool, str]:
  """(rows, length, packed, why the run would refuse its budget) of the run's largest trainer call: a full packed call
  as `MicroBatcher` cuts it (its tokens within the activation budget the chip's memory gives), or `chunk_rows`
  padded rows of the longest sample; where the budget holds no packed row, a row a batch shard, and the reason."""
  if not setup.trainer.packing:
    return setup.trainer.chunk_rows, bucket(setup.shape.longest, trainer.min_length), False, ""
  try:
    settings = packing(setup.trainer, setup.shape, graphdef, params, mesh, device_bytes=int(chip.hbm_bytes))
  except ValueError as refused:  # the run would stop at start: its budget holds no row; plan the smallest call
    if not str(refused).startswith("TrainerConfig.activation_budget_mb="):
      raise
    return trainer.packed_row_quantum, packed_length(setup.trainer, setup.shape), True, str(refused)
  length = settings["pack_length"]
  return call_rows(trainer.packed_row_quantum, settings["chunk_tokens"], length), length, True, ""


def _step_rows(setup: PlanSetup, width: int, packed: bool, new_tokens: float) -> int:
  """Trainer rows of one step: a sample a row when samples take more than half a packed row, else the rows their
  tokens fill; unpacked, a row a sample."""
  samples = setup.shape.samples_per_step
  sample = setup.engine.max_prompt_length + new_tokens
  if not packed or 2 * sample > width:
    return samples
  return math.ceil(samples * sample / width)
