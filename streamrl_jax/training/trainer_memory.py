"""What a trainer's programs are compiled to hold on a TPU: the memory each may use beside the arrays it does not take
(`models.device_memory`), and the variables whose gradients are fenced layer by layer (`models.gradient_fence`)."""

from __future__ import annotations

import jax
from flax import nnx

from streamrl_jax.models.compile_target import target_backend
from streamrl_jax.models.device_memory import device_bytes, memory_limit


def fenced_variables(lora_base) -> type | None:
  """What the trainer's calls differentiate, fenced layer by layer on a TPU (`models.gradient_fence`: measured there
  alone): the parameters, or LoRA's adapters where the trainer holds a frozen base (`lora_base`); None elsewhere."""
  if target_backend() != "tpu":
    return None
  return nnx.Param if lora_base is None else nnx.LoRAParam


def compile_limits(state, frozen: dict, compute_dtype) -> tuple[dict, dict]:
  """The compiler options of the gradient call and of the optimizer step: on a TPU each is compiled for the memory
  its device has left beside it (`models.device_memory`), the call beside the optimizer's moments, the step beside
  the frozen models, both beside the version being published (the policy, LoRA's base with its adapters merged, in
  the compute dtype, sharded as the parameters). `state` a `TrainState`; `frozen` the trainer's frozen models."""
  if target_backend() != "tpu":
    return {}, {}
  device = next(iter(jax.tree.leaves(state.params)[0].sharding.device_set))
  policy = state.params if frozen["base"] is None else frozen["base"]
  published = device_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute_dtype, sharding=x.sharding),
                                        policy))
  resident = device_bytes(state) + device_bytes(frozen)
  return (memory_limit(device, device_bytes(state.opt_state) + published, resident),
          memory_limit(device, device_bytes(frozen) + published, resident))
