"""A step's work on one device, counted from the model's shapes (`Work`: FLOPs, HBM bytes, interconnect bytes), and its
roofline time on a chip: the slowest of computing at the chip's peak, moving its bytes at its memory bandwidth and its
collectives at its interconnect's, as if the three overlapped perfectly (a lower bound on the step's time).

Counted, not read from XLA: XLA's cost analysis counts a loop's body once (the head's vocabulary chunks, a decode
scan) and a Pallas kernel's work not at all; a plan prints XLA's figures beside these.

- A trainer call of `tokens` over `devices` (rows split over the batch shards, weights over FSDP and tensor): forward
  FLOPs `ModelConfig.flops_per_token` at the mean causal context, times 3 for the backward pass (2 with LoRA: no weight
  gradient of the base), plus a forward for rematerialisation and one for a KL reference (`trainer_passes`). The
  forward, the backward and each further pass read the whole gathered weights in the compute dtype on every device and
  gather them over FSDP; the gradient is written whole in float32 before it is reduce-scattered, then added to the
  running sum (its shard read and written); activations are written in the forward pass and read in the backward.
- The optimizer step reads the weights, gradient and two moments (float32) and writes three of them, on its shard.
- A decode step of `rows` over `devices` (tensor parallel): every row's token through the model (its context's keys
  and values read), the weights read once, two all-reduces of the rows' hidden states a layer.
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.models import ModelConfig
from streamrl_jax.planning.chips import Chip


@dataclasses.dataclass(frozen=True)
class Work:
  """One device's work in a step."""

  flops: float
  hbm_bytes: float
  ici_bytes: float = 0.0

  def __add__(self, other: Work) -> Work:
    return Work(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, self.ici_bytes + other.ici_bytes)

  def __mul__(self, times: float) -> Work:
    return Work(self.flops * times, self.hbm_bytes * times, self.ici_bytes * times)

  def terms(self, chip: Chip) -> dict[str, float]:
    """Seconds of each resource alone: compute, memory, interconnect (one direction of its bidirectional rate)."""
    ici = self.ici_bytes / (chip.ici_bytes_per_s / 2) if chip.ici_bytes_per_s else 0.0
    return {"compute": self.flops / chip.peak_flops, "memory": self.hbm_bytes / chip.hbm_bytes_per_s, "ici": ici}

  def seconds(self, chip: Chip) -> float:
    return max(self.terms(chip).values())

  def bound(self, chip: Chip) -> str:
    terms = self.terms(chip)
    return max(terms, key=terms.get)


def kv_bytes_per_token(config: ModelConfig, context: float, itemsize: int) -> float:
  """Bytes of keys and values a token reads over `context` earlier tokens, each sliding layer its window at most."""
  per_layer = 2 * config.num_kv_heads * config.head_dim * itemsize
  return sum(per_layer * min(context, window or context) for window in config.windows)


def active_params(config: ModelConfig) -> float:
  """The weights a token multiplies (a mixture's routed experts alone, the head included)."""
  return config.flops_per_token(0) / 2


def trainer_call(config: ModelConfig, tokens: int, devices: int, shape: TrainerShape) -> Work:
  """A trainer call of `tokens` (padding included) in rows of `shape.length`, on one of `devices`."""
  forward = tokens * config.flops_per_token(shape.length / 2)
  passes = trainer_passes(shape.lora, shape.remat, shape.reference)
  params = config.param_count()
  # every pass reads the gathered weights: the forward, the backward's input gradient (LoRA too), a recompute, a KL
  # reference's forward (the weight gradient reads activations alone)
  weights = (2 + (shape.remat != "none") + shape.reference) * params * shape.compute_bytes
  gradient = 0.0 if shape.lora else 4 * params + 8 * params / devices
  layer = 8 * config.hidden_size + 2 * config.num_kv_heads * config.head_dim + 3 * config.intermediate_size
  activations = 2 * tokens / shape.batch_shards * config.num_layers * layer * shape.compute_bytes
  fsdp = (shape.fsdp - 1) / shape.fsdp
  gathers = weights * fsdp + (0.0 if shape.lora else 4 * params * fsdp)
  tensor = (shape.tensor - 1) / shape.tensor
  all_reduces = 4 * 2 * config.num_layers * tokens / shape.batch_shards * config.hidden_size * shape.compute_bytes
  return Work(forward * passes / devices, weights + gradient + activations, gathers + all_reduces * tensor)


def trainer_passes(lora: bool, remat: str, reference: bool) -> int:
  """A trainer call's FLOPs in forward passes: the forward and a backward of twice its work (LoRA: once, no weight
  gradient of the base), a forward again under rematerialisation, and a KL reference's forward."""
  return (2 if lora else 3) + (remat != "none") + int(reference)


def optimizer_step(config: ModelConfig, devices: int, lora_params: int = 0) -> Work:
  """AdamW on this device's shard: weights, gradient and moments read (16 bytes a parameter), three written (12)."""
  params = lora_params or config.param_count()
  return Work(12 * params / devices, 28 * params / devices)


def decode_step(config: ModelConfig, rows: int, context: float, devices: int, weight_bytes: int,
                cache_bytes: int) -> Work:
  """One decode step of `rows` rows at a mean `context` on one of `devices` (tensor parallel): `weight_bytes` a
  parameter as the sampler holds them, `cache_bytes` a key or value entry."""
  flops = rows * config.flops_per_token(context) / devices
  hbm = (config.param_count() * weight_bytes + rows * kv_bytes_per_token(config, context, cache_bytes)) / devices
  ici = 2 * 2 * config.num_layers * rows * config.hidden_size * 2 * (devices - 1) / devices
  return Work(flops, hbm, ici)


def prefill_call(config: ModelConfig, prompts: int, length: int, devices: int, weight_bytes: int,
                 cache_bytes: int) -> Work:
  """A prefill call of `prompts` prompts of `length` tokens on one of `devices`: their keys and values written."""
  tokens = prompts * length
  flops = tokens * config.flops_per_token(length / 2) / devices
  hbm = (config.param_count() * weight_bytes + tokens * kv_bytes_per_token(config, 1, cache_bytes)) / devices
  ici = 2 * 2 * config.num_layers * tokens * config.hidden_size * 2 * (devices - 1) / devices
  return Work(flops, hbm, ici)


@dataclasses.dataclass(frozen=True)
class TrainerShape:
  """What a trainer call's work depends on beyond the model: its rows' length, the mesh's batch shards, FSDP and
  tensor sizes, the rematerialisation policy, a KL reference's forward pass, LoRA, the compute dtype's bytes."""

  length: int
  batch_shards: int
  fsdp: int
  tensor: int
  remat: str = "none"
  reference: bool = False
  lora: bool = False
  compute_bytes: int = 2
