"""What a plan estimates before it compiles, to choose a split: each side's memory from the model's shapes (does the
split fit?) and the simulator's profile at a split (decode steps by rows, the trainer's FLOPs a token, its optimizer
step)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from streamrl_jax.models import ModelConfig
from streamrl_jax.models.device_memory import HEADROOM
from streamrl_jax.models.layers import cache_dtype
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.planning.chips import GIB, Chip
from streamrl_jax.models.lora import adapter_param_count
from streamrl_jax.planning.roofline import kv_bytes_per_token, optimizer_step, trainer_passes
from streamrl_jax.planning.sampler_plan import decode_curve, sampler_model


ESTIMATE_SHARE = 0.8  # of a chip's usable memory, what the state a split's estimate counts may take


@dataclasses.dataclass(frozen=True)
class Profile:
  """What the simulator needs of a plan: a decode step's seconds by rows, the trainer's FLOPs a token, its
  optimizer step's seconds, and each side's share of its roofline."""

  decode_curve: tuple[tuple[int, float], ...]
  train_flops_per_token: float
  optimizer_s: float
  efficiency: float


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


def fits_estimate(setup: PlanSetup, model: ModelConfig, chip: Chip, trainer: int) -> bool:
  """Whether a split of `trainer` trainer chips plausibly fits: the trainer's state and an engine instance's weights
  and cache each under `ESTIMATE_SHARE` of `HEADROOM` of the chip (the rest for a call's activations, a prefill's
  temporaries)."""
  limit = ESTIMATE_SHARE * HEADROOM * chip.hbm_bytes
  return trainer_state_bytes(setup, model, trainer) <= limit and sampler_instance_bytes(setup, model) <= limit


def profile_at(setup: PlanSetup, model: ModelConfig, chip: Chip, trainer: int, new_tokens: float,
               efficiency: float) -> Profile:
  """The simulator's profile of the run with `trainer` trainer chips, its samples `new_tokens` long at the median."""
  lora = setup.trainer.lora.enabled
  passes = trainer_passes(lora, setup.trainer.remat, setup.trainer.objective.kl_coef > 0)
  flops = passes * model.flops_per_token((setup.engine.max_prompt_length + new_tokens) / 2)
  adapters = adapter_param_count(setup.trainer.lora, model) if lora else 0
  optimizer = optimizer_step(model, trainer, adapters).seconds(chip)
  return Profile(decode_curve(setup, model, chip, new_tokens, efficiency), flops, optimizer / efficiency, efficiency)


def why_not(setup: PlanSetup, model: ModelConfig, chip: Chip, total: int) -> str:
  """What the memory estimate found too large at the split that leaves each side the most chips it can have."""
  out, limit = [], ESTIMATE_SHARE * HEADROOM * chip.hbm_bytes
  tensor = setup.mesh.sampler_tensor_parallel
  instance = sampler_instance_bytes(setup, model)
  if instance > limit:
    out.append(f"an engine instance needs {instance / GIB:.1f} GiB a chip of {chip.hbm_bytes / GIB:.2f}: "
               f"MeshConfig.sampler_tensor_parallel={2 * tensor} or fewer EngineConfig.num_slots")
  trainer = trainer_state_bytes(setup, model, total - tensor)
  if trainer > limit:
    out.append(f"the trainer's state needs {trainer / GIB:.1f} GiB a chip on {total - tensor} chips: more chips or "
               "LoRA")
  return "; ".join(out) or ("each side fits alone, no split of whole engine instances leaves the trainer a shardable "
                            "count")
