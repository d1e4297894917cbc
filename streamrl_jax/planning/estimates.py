"""What a plan estimates before it compiles, to choose a split: each side's memory from the model's shapes (does the
split fit?) and the simulator's profile at a split (decode steps by rows, the trainer's FLOPs a token, its optimizer
step)."""

from __future__ import annotations

import jax.numpy as jnp

from streamrl_jax.models import ModelConfig
from streamrl_jax.models.layers import cache_dtype
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.planning.chips import Chip
from streamrl_jax.planning.roofline import kv_bytes_per_token, optimizer_step
from streamrl_jax.planning.sampler_plan import decode_curve, sampler_model
from streamrl_jax.planning.split import Profile


def trainer_state_bytes(setup: PlanSetup, model: ModelConfig, chips: int) -> float:
  """A trainer chip's share of the weights, gradient and moments (float32), and of a KL reference: the bytes it holds
  before any call's activations (LoRA: the frozen base alone, its adapters are small)."""
  params = model.param_count()
  if setup.trainer.lora.enabled:
    return 4 * params / chips
  reference = 4 * params if setup.trainer.objective.kl_coef > 0 else 0
  return (16 * params + reference) / chips


def sampler_instance_bytes(setup: PlanSetup, model: ModelConfig) -> float:
  """An engine instance chip's share of its weights and of its KV cache at every slot full (paged: its pool)."""
  engine, tensor = setup.engine, setup.mesh.sampler_tensor_parallel
  held = sampler_model(setup, model)
  weights = model.param_count() * jnp.dtype(held.weight_dtype).itemsize
  tokens = (engine.kv_pages * engine.page_size if engine.kv_layout == "paged" and engine.kv_pages
            else engine.num_slots * engine.cache_length)
  kv = tokens * kv_bytes_per_token(held, 1, jnp.dtype(cache_dtype(held.compute_dtype)).itemsize)  # a token's entry
  return (weights + kv) / tensor


def fits_estimate(setup: PlanSetup, model: ModelConfig, chip: Chip, sampler: int, trainer: int,
                  headroom: float) -> bool:
  """Whether a split plausibly fits: the trainer's state and an engine instance's weights and cache each under 80%
  of `headroom` of the chip (the rest for a call's activations, a prefill's temporaries)."""
  limit = 0.8 * headroom * chip.hbm_bytes
  return trainer_state_bytes(setup, model, trainer) <= limit and sampler_instance_bytes(setup, model) <= limit


def profile_at(setup: PlanSetup, model: ModelConfig, chip: Chip, trainer: int, new_tokens: float,
               efficiency: float) -> Profile:
  """The simulator's profile of the run with `trainer` trainer chips."""
  lora, remat = setup.trainer.lora.enabled, setup.trainer.remat != "none"
  passes = (2 if lora else 3) + remat + (setup.trainer.objective.kl_coef > 0)
  length = setup.engine.max_prompt_length + setup.shape.max_new_tokens
  flops = passes * model.flops_per_token(length / 2)
  optimizer = optimizer_step(model, trainer, 0 if not lora else max(1, model.param_count() // 1000)).seconds(chip)
  return Profile(decode_curve(setup, model, chip, new_tokens, efficiency), flops, optimizer / efficiency, efficiency)
