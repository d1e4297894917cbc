"""Typed, frozen configuration of the one decoder every family shares (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3).

A family is a set of switches here (q/k norms, Gemma's norms and scaled embeddings, sliding-window layers, experts);
`models.families` reads and writes a checkpoint's `config.json` for each.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3")  # ModelConfig.architecture
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # a run's choice of activation and matmul dtype
ACCELERATED_BACKENDS = ("gpu", "cuda", "rocm", "tpu")  # where 'auto' computes in bfloat16
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation
LAYER_TYPES = ("full", "sliding")  # a layer attends to every earlier position, or to a window of them
ROPE_TYPES = ("llama3", "linear")  # rope scaling implemented (config.json's rope_type)


REMAT_POLICIES = ("none", "layer", "dots")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Rope scaling: Llama 3's frequency-dependent one (`rope_type: llama3`), or every frequency divided by `factor`
  (`rope_type: linear`, Gemma 3's global layers)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_type: str = "llama3"

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"RopeScaling.rope_type={self.rope_type!r}; implemented: {list(ROPE_TYPES)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the decoder. The defaults are Llama's; each family sets its own switches."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0: hidden_size // num_heads
  architecture: str = "llama"  # the family (FAMILIES): which config.json and tensor names it reads and writes
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
  qk_norm: bool = False  # an RMSNorm over head_dim on queries and keys before rope (Qwen3, Gemma 3)
  norm_offset: float = 0.0  # every norm scales by norm_offset + weight (Gemma: 1)
  sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (Gemma 3)
  embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
  hidden_act: str = "silu"  # the MLP's gate activation: silu or gelu_tanh
  query_scale: float = 0.0  # attention logits' scale; 0: head_dim ** -0.5
  layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding" (LAYER_TYPES); (): every layer full
  sliding_window: int = 0  # a sliding layer's query sees this many positions, its own included
  local_rope_theta: float = 0.0  # sliding layers' rope base, unscaled (Gemma 3's local base); 0: as full layers
  num_experts: int = 0  # a mixture of experts: experts of each sparse layer; 0: every MLP dense
  experts_per_token: int = 0  # experts each token is routed to (top-k of the router's softmax)
  moe_intermediate_size: int = 0  # one expert's MLP width
  norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
  dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (config.json's mlp_only_layers)
  sparse_step: int = 1  # every sparse_step-th layer is sparse (decoder_sparse_step)
  router_aux_loss_coef: float = 0.0  # config.json's weight of the load-balancing loss (what a checkpoint states)

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
    for name in ("eos_token_id", "layer_types", "dense_layers"):
      if isinstance(getattr(self, name), list):
        object.__setattr__(self, name, tuple(getattr(self, name)))
    remat = {False: "none", True: "layer"}[self.remat] if isinstance(self.remat, bool) else self.remat
    if remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; known: {list(REMAT_POLICIES)}")
    object.__setattr__(self, "remat", remat)
    if self.architecture not in FAMILIES:
      raise ValueError(f"ModelConfig.architecture={self.architecture!r}; known: {list(FAMILIES)}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; known: {sorted(DTYPES)}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"ModelConfig.hidden_act={self.hidden_act!r}; known: {list(ACTIVATIONS)}")
    self._check_layers()
    self._check_experts()

  def _check_layers(self):
    if self.layer_types and len(self.layer_types) != self.num_layers:
      raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
    unknown = [t for t in self.layer_types if t not in LAYER_TYPES]
    if unknown:
      raise ValueError(f"ModelConfig.layer_types: unknown {unknown[0]!r}; known: {list(LAYER_TYPES)}")
    if "sliding" in self.layer_types and self.sliding_window < 1:
      raise ValueError(f"ModelConfig.sliding_window={self.sliding_window}: sliding layers need a window >= 1")

  def _check_experts(self):
    if not self.num_experts:
      return
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"ModelConfig.experts_per_token={self.experts_per_token} must lie in [1, num_experts="
                       f"{self.num_experts}]")
    if self.moe_intermediate_size < 1 or self.sparse_step < 1:
      raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size} and sparse_step="
                       f"{self.sparse_step} must be >= 1 in a mixture of experts")

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of `layer`, None for a full-attention layer."""
    return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding" else None

  @property
  def windows(self) -> tuple[int | None, ...]:
    """Each layer's window (`layer_window`)."""
    return tuple(self.layer_window(i) for i in range(self.num_layers))

  def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
    """(rope base, scaling) of `layer`: a sliding layer's own unscaled base where the config has one (Gemma 3)."""
    if self.layer_window(layer) is not None and self.local_rope_theta:
      return self.local_rope_theta, None
    return self.rope_theta, self.rope_scaling

  def is_moe_layer(self, layer: int) -> bool:
    """Whether `layer`'s MLP is a mixture of experts (Qwen3-MoE's rule: not in mlp_only_layers, every
    decoder_sparse_step-th layer)."""
    return self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

  def _mlp_weights(self, layer: int, active: bool) -> int:
    """A layer's MLP weights (`active`: those a token multiplies, its routed experts and the router)."""
    h = self.hidden_size
    if not self.is_moe_layer(layer):
      return 3 * h * self.intermediate_size
    experts = self.experts_per_token if active else self.num_experts
    return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts

  def param_count(self) -> int:
    """Number of parameters, embeddings included."""
    h, d, q, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
    attn = h * d * (q + 2 * kv) + q * d * h
    attn += (q + 2 * kv) * d * self.qkv_bias + h * self.o_bias + 2 * d * self.qk_norm
    norms = (4 if self.sandwich_norms else 2) * h
    layers = sum(attn + norms + self._mlp_weights(i, active=False) for i in range(self.num_layers))
    head = 0 if self.tie_embeddings else h * self.vocab_size
    return self.vocab_size * h + layers + h + head

  def flops_per_token(self, context_length: int) -> float:
    """Forward matmul FLOPs per token: 2 x the weights it multiplies (a mixture's routed experts alone), plus
    attention over `context_length` keys (a sliding layer's window at most)."""
    h, d, q, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
    matmul = sum(h * d * (q + 2 * kv) + q * d * h + self._mlp_weights(i, active=True) for i in range(self.num_layers))
    matmul += h * self.vocab_size
    attention = sum(2 * q * d * min(context_length, self.layer_window(i) or context_length)
                    for i in range(self.num_layers))
    return 2.0 * (matmul + attention)
