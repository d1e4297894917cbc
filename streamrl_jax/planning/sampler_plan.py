"""The sampler's side of a plan: one engine instance as the run builds it (`sampling.engines.make_engine`, the run's
KV layout, slots and lengths) on `MeshConfig.sampler_tensor_parallel` chips, its weights in the sampler's precision,
its largest prefill call and a decode step of every slot compiled for that chip; and a decode step's work."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, abstract_model
from streamrl_jax.models.device_memory import device_bytes
from streamrl_jax.models.layers import cache_dtype
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.planning.chips import Chip
from streamrl_jax.planning.compiled import program_cost
from streamrl_jax.planning.roofline import decode_step, prefill_call
from streamrl_jax.planning.sides import SidePlan, peaks_of
from streamrl_jax.planning.trainer_plan import shapes
from streamrl_jax.sampling.engines import make_engine

# the weights a sampler computes with, by its precision: int8 is dequantized to float32 on the sampler
WEIGHT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32"}


def sampler_model(setup: PlanSetup, model: ModelConfig) -> ModelConfig:
  """The model as a sampler holds it: weights in the dtype its precision decodes to."""
  return dataclasses.replace(model, param_dtype=WEIGHT_DTYPES[setup.precision.precision])


def plan_sampler(setup: PlanSetup, model: ModelConfig, devices: list, chip: Chip,
                 new_tokens: float) -> SidePlan:
  """One engine instance on the first `MeshConfig.sampler_tensor_parallel` of `devices`, its rows `new_tokens`
  into their completions at the median (the mean context a decode step reads: the prompt and half of those)."""
  tensor = setup.mesh.sampler_tensor_parallel
  if len(devices) < tensor:
    raise ValueError(f"MeshConfig.sampler_tensor_parallel={tensor} is more than the plan's {len(devices)} sampler "
                     "chips")
  mesh = mesh_from_devices(devices[:tensor], MeshShape(1, 1, tensor))
  held_model = sampler_model(setup, model)
  graphdef, abstract = abstract_model(held_model)
  engine_config = dataclasses.replace(setup.engine, memory_budget_bytes=1 << 62)  # the plan judges memory
  engine = make_engine(graphdef, held_model, engine_config, mesh)
  params = engine.place_params(shapes(abstract))
  calls, state = engine.planned_calls(params)
  programs = {name: program_cost(f"sampler.{name}", call.lowered) for name, call in calls.items()}
  held = {"weights": device_bytes(params), "decode_state": device_bytes(state)}
  arguments = {name: {"weights"} | ({"decode_state"} if call.reads_state else set()) for name, call in calls.items()}
  ec = engine_config
  weight_bytes = jnp.dtype(held_model.weight_dtype).itemsize
  kv_bytes = jnp.dtype(cache_dtype(held_model.compute_dtype)).itemsize
  context = ec.max_prompt_length + new_tokens / 2
  step = decode_step(held_model, ec.num_slots, context, tensor, weight_bytes, kv_bytes)
  prefill = prefill_call(held_model, ec.prefill_batch, ec.max_prompt_length, tensor, weight_bytes, kv_bytes)
  notes = dict(kv_layout=ec.kv_layout, slots=ec.num_slots, cache_length=ec.cache_length, context=context,
               attention=ec.attention, precision=setup.precision.precision, weight_bytes=weight_bytes,
               kv_bytes=kv_bytes, prefill_call=prefill.seconds(chip), prefill_prompts=ec.prefill_batch)
  return SidePlan("sampler", dict(mesh.shape), tuple(programs.values()), held, peaks_of(programs, held, arguments),
                  step, notes)


def decode_curve(setup: PlanSetup, model: ModelConfig, chip: Chip, new_tokens: float,
                 efficiency: float) -> tuple[tuple[int, float], ...]:
  """(rows, seconds) of a decode step at each power of two up to the engine's slots, at the roofline over
  `efficiency`: the per-token latency profile the simulator dispatches with."""
  ec, tensor = setup.engine, setup.mesh.sampler_tensor_parallel
  held = sampler_model(setup, model)
  weight_bytes = jnp.dtype(held.weight_dtype).itemsize
  kv_bytes = jnp.dtype(cache_dtype(held.compute_dtype)).itemsize
  context = ec.max_prompt_length + new_tokens / 2
  rows = sorted({min(1 << k, ec.num_slots) for k in range(ec.num_slots.bit_length() + 1)})
  return tuple((r, decode_step(held, r, context, tensor, weight_bytes, kv_bytes).seconds(chip) / efficiency)
               for r in rows)
