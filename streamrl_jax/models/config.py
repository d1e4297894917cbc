"""Typed, frozen configuration of the Llama/Qwen2 decoder, and its Hugging Face `config.json` mapping."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # a run's choice of activation and matmul dtype
ACCELERATED_BACKENDS = ("gpu", "cuda", "rocm", "tpu")  # where 'auto' computes in bfloat16


def resolve_compute_dtype(choice: str, backend: str | None = None) -> str:
  """The activation and matmul dtype `choice` means on `backend` (default: this process's jax backend): 'auto' is
  bfloat16 on an accelerator, whose matrix units run it several times faster than float32, and float32 on a CPU,
  where that holds only on some (bfloat16 matrix units, as Intel's AMX: there a config may name 'bfloat16';
  as configs/smollm2_cpu.gin does). Weights (the optimizer's master copy) stay float32 either way."""
  if choice not in COMPUTE_DTYPES:
    raise ValueError(f"compute dtype {choice!r}; known: {list(COMPUTE_DTYPES)}")
  if choice != "auto":
    return choice
  if backend is None:
    import jax

    backend = jax.default_backend()
  return "bfloat16" if backend in ACCELERATED_BACKENDS else "float32"


def cpu_bfloat16_matrix_units(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether this machine's CPU has bfloat16 matrix units (Intel AMX: `amx_bf16` among `cpuinfo`'s flags), where
  bfloat16 products run several times faster than float32's; False where the file cannot say."""
  try:
    with open(cpuinfo) as info:
      return any(line.startswith("flags") and "amx_bf16" in line.split() for line in info)
  except OSError:
    return False


REMAT_POLICIES = ("none", "layer", "dots")

@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency-dependent rope scaling (`rope_type: llama3` in config.json)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer of the Llama/Qwen2 family."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0: hidden_size // num_heads
  architecture: str = "llama"
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  o_bias: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 4096
  dtype: str = "float32"  # activations and matmuls
  param_dtype: str = "float32"
  # rematerialisation in training: "none", "layer" (a layer saves only its input; its inside is recomputed in the
  # backward pass) or "dots" (a layer also saves its weight matmuls' outputs; attention and norms are recomputed).
  # True and False are "layer" and "none".
  remat: bool | str = "none"
  initializer_range: float = 0.02
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
    if self.head_dim == 0:
      if self.hidden_size % self.num_heads:
        raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                         "set head_dim explicitly")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    remat = {False: "none", True: "layer"}[self.remat] if isinstance(self.remat, bool) else self.remat
    if remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; known: {list(REMAT_POLICIES)}")
    object.__setattr__(self, "remat", remat)
    if self.architecture not in ARCHITECTURES.values():
      raise ValueError(f"ModelConfig.architecture={self.architecture!r}; known: {sorted(ARCHITECTURES.values())}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; known: {sorted(DTYPES)}")

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  def param_count(self) -> int:
    """Number of parameters, embeddings included."""
    h, d, q, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
    attn = h * d * (q + 2 * kv) + q * d * h
    attn += (q + 2 * kv) * d * self.qkv_bias + h * self.o_bias
    layer = attn + 3 * h * self.intermediate_size + 2 * h
    head = 0 if self.tie_embeddings else h * self.vocab_size
    return self.vocab_size * h + self.num_layers * layer + h + head

  def flops_per_token(self, context_length: int) -> float:
    """Forward matmul FLOPs per token: 2 x matmul weights, plus attention over `context_length` keys."""
    h, d, q, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
    matmul = self.num_layers * (h * d * (q + 2 * kv) + q * d * h + 3 * h * self.intermediate_size)
    matmul += h * self.vocab_size
    attention = self.num_layers * 2 * q * d * context_length
    return 2.0 * (matmul + attention)

  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
    """Builds a config from a Hugging Face `config.json` dictionary."""
    archs = hf.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
      raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
                       f"supported: {sorted(ARCHITECTURES)}")
    if hf.get("mlp_bias"):
      raise ValueError("config.json sets mlp_bias=true, which this decoder does not support")
    if hf.get("use_sliding_window"):
      raise ValueError("config.json sets use_sliding_window=true, which this decoder does not support")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    rope_theta = hf.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
    scaling = None
    if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
      if rope.get("rope_type", rope.get("type")) != "llama3":
        raise ValueError(f"unsupported rope_scaling {rope!r} in config.json; supported: llama3")
      scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                            rope["original_max_position_embeddings"])
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, architecture=arch,
        rope_theta=float(rope_theta), rope_scaling=scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias")),
        o_bias=arch == "llama" and bool(hf.get("attention_bias")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"))
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict[str, Any]:
    """The `config.json` dictionary that transformers reads back into the same model."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[self.architecture]
    out = dict(
        architectures=[arch], model_type=self.architecture, vocab_size=self.vocab_size,
        hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_act="silu",
        rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        tie_word_embeddings=self.tie_embeddings, max_position_embeddings=self.max_position_embeddings,
        initializer_range=self.initializer_range, torch_dtype=self.param_dtype,
        bos_token_id=self.bos_token_id,
        eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id)
    if self.architecture == "llama":
      if self.qkv_bias != self.o_bias:
        raise ValueError("Llama checkpoints bias either all of q/k/v/o or none of them")
      out.update(attention_bias=self.qkv_bias, mlp_bias=False)
    elif not self.qkv_bias or self.o_bias:
      raise ValueError("Qwen2 checkpoints bias q/k/v and not o; set qkv_bias=True, o_bias=False")
    if self.rope_scaling is not None:
      out["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
    return out
