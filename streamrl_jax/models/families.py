"""The model families a checkpoint's `config.json` may name, read into one `ModelConfig` and written back.

Each family is its architecture name, its `model_type`, and the switches of the one decoder it sets (q/k norms,
Gemma's norms, sliding windows, experts). What a family has and this decoder lacks (Gemma 3's vision tower, a rope
type not implemented, logit soft-capping) is refused by name here, before any weight is read.
"""

from __future__ import annotations

import math
from typing import Any

from streamrl_jax.models.config import ModelConfig, RopeScaling

# config.json's `architectures` -> ModelConfig.architecture, and back
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma3ForCausalLM": "gemma3"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "gemma3": "gemma3_text"}
# architectures refused with a reason of their own (what the family has that this decoder does not)
REFUSED = {
    "Gemma3ForConditionalGeneration": "Gemma 3's vision tower and multimodal projector are not supported (this "
                                      "decoder is text-only); use a text-only Gemma 3 (Gemma3ForCausalLM, as "
                                      "google/gemma-3-1b-it)",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


class UnsupportedModel(ValueError):
  """A config.json this decoder cannot run; the message names the key and what is supported."""


def family_of(hf: dict[str, Any]) -> str:
  """The family of a config.json dictionary; refuses an unknown or unsupported architecture by name."""
  archs = hf.get("architectures") or []
  for name in archs:
    if name in REFUSED:
      raise UnsupportedModel(f"architecture {name!r} in config.json: {REFUSED[name]}")
  family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if family is None:
    raise UnsupportedModel(f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
                           f"supported: {sorted(ARCHITECTURES)}")
  return family


def _rope(params: dict | None, key: str) -> RopeScaling | None:
  """The scaling a rope parameter dictionary describes; a rope type not implemented is refused by name."""
  kind = (params or {}).get("rope_type", (params or {}).get("type"))
  if kind in (None, "default"):
    return None
  if kind == "llama3":
    return RopeScaling(params["factor"], params["low_freq_factor"], params["high_freq_factor"],
                       params["original_max_position_embeddings"])
  if kind == "linear":
    return RopeScaling(factor=float(params["factor"]), rope_type="linear")
  raise UnsupportedModel(f"config.json's {key} has rope_type {kind!r}, which is not implemented; implemented: "
                         "default, llama3, linear")


def _theta(hf: dict, params: dict | None, default: float) -> float:
  return float(hf.get("rope_theta") or (params or {}).get("rope_theta") or default)


def _common(hf: dict[str, Any]) -> dict[str, Any]:
  """The fields every family reads the same way."""
  if hf.get("mlp_bias"):
    raise UnsupportedModel("config.json sets mlp_bias=true, which this decoder does not support")
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  if act not in _ACTIVATIONS:
    raise UnsupportedModel(f"config.json's hidden_act {act!r} is not implemented; implemented: {sorted(_ACTIVATIONS)}")
  heads = hf["num_attention_heads"]
  return dict(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      initializer_range=hf.get("initializer_range", 0.02), bos_token_id=hf.get("bos_token_id"),
      eos_token_id=hf.get("eos_token_id"), hidden_act=_ACTIVATIONS[act])


def _windows(hf: dict[str, Any], layers: int, rule) -> dict[str, Any]:
  """layer_types and sliding_window: config.json's `layer_types`, else `rule(i)` (True: layer i slides)."""
  named = hf.get("layer_types")
  if named:
    unknown = [t for t in named if t not in _LAYER_TYPES]
    if unknown:
      raise UnsupportedModel(f"config.json's layer_types has {unknown[0]!r}; supported: {sorted(_LAYER_TYPES)}")
    types = tuple(_LAYER_TYPES[t] for t in named)
  else:
    types = tuple("sliding" if rule(i) else "full" for i in range(layers))
  if "sliding" not in types:
    return {}
  if not hf.get("sliding_window"):
    raise UnsupportedModel("config.json has sliding-window layers but no sliding_window size")
  return dict(layer_types=types, sliding_window=int(hf["sliding_window"]))


def _llama_like(hf: dict[str, Any], family: str) -> dict[str, Any]:
  """Llama, Qwen2, Qwen3 and Qwen3-MoE: the rope and the sliding layers of a Qwen config."""
  params = hf.get("rope_scaling") or hf.get("rope_parameters")
  fields = dict(rope_theta=_theta(hf, params, 10000.0), rope_scaling=_rope(params, "rope_scaling"))
  if family != "llama" and hf.get("use_sliding_window"):
    if family == "qwen3_moe":
      raise UnsupportedModel("config.json sets use_sliding_window=true for a Qwen3-MoE model, which is not supported")
    start = hf.get("max_window_layers", 28)
    fields.update(_windows(hf, hf["num_hidden_layers"], lambda i: i >= start))
  bias = bool(hf.get("attention_bias"))
  fields.update(qkv_bias=family == "qwen2" or bias, o_bias=family in ("llama", "qwen3", "qwen3_moe") and bias,
                qk_norm=family in ("qwen3", "qwen3_moe"))
  if family == "qwen3_moe":
    fields.update(num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
                  experts_per_token=hf["num_experts_per_tok"], moe_intermediate_size=hf["moe_intermediate_size"],
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  dense_layers=tuple(hf.get("mlp_only_layers") or ()), sparse_step=hf.get("decoder_sparse_step", 1),
                  router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
  return fields


def _gemma3(hf: dict[str, Any]) -> dict[str, Any]:
  """Gemma 3 text: (1 + w) norms, four a layer, q/k norms, scaled embeddings, sliding layers with their own base."""
  for key in ("attn_logit_softcapping", "final_logit_softcapping"):
    if hf.get(key) is not None:
      raise UnsupportedModel(f"config.json sets {key}={hf[key]}: logit soft-capping is not implemented")
  if hf.get("use_bidirectional_attention"):
    raise UnsupportedModel("config.json sets use_bidirectional_attention=true: only causal attention is implemented")
  params = hf.get("rope_parameters") or {}
  full = params.get("full_attention", params if "rope_type" in params else None) or hf.get("rope_scaling")
  local = params.get("sliding_attention")
  if _rope(local, "rope_parameters.sliding_attention") is not None:
    raise UnsupportedModel("config.json scales the sliding layers' rope: not implemented (only the global layers')")
  pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
  fields = dict(rope_theta=_theta(hf, full, 1_000_000.0), rope_scaling=_rope(full, "rope_parameters"),
                local_rope_theta=float(hf.get("rope_local_base_freq") or (local or {}).get("rope_theta") or 10_000.0),
                qkv_bias=bool(hf.get("attention_bias")), o_bias=bool(hf.get("attention_bias")), qk_norm=True,
                norm_offset=1.0, sandwich_norms=True, embed_scale=True,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),  # Gemma's own default: tied
                query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5)
  fields.update(_windows(hf, hf["num_hidden_layers"], lambda i: bool((i + 1) % pattern)))
  return fields


def config_from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """A `ModelConfig` from a Hugging Face `config.json` dictionary (`overrides` set other fields)."""
  family = family_of(hf)
  fields = _common(hf)
  fields.update(_gemma3(hf) if family == "gemma3" else _llama_like(hf, family))
  fields.update(architecture=family, **overrides)
  return ModelConfig(**fields)


def _rope_out(scaling: RopeScaling | None) -> dict | None:
  if scaling is None:
    return None
  if scaling.rope_type == "linear":
    return dict(rope_type="linear", factor=scaling.factor)
  return dict(rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
              high_freq_factor=scaling.high_freq_factor,
              original_max_position_embeddings=scaling.original_max_position_embeddings)


def _family_out(c: ModelConfig) -> dict[str, Any]:
  """The keys of config.json that belong to `c`'s family."""
  types = [{"full": "full_attention", "sliding": "sliding_attention"}[t] for t in c.layer_types]
  if c.architecture == "gemma3":
    out = dict(hidden_activation="gelu_pytorch_tanh" if c.hidden_act == "gelu_tanh" else c.hidden_act,
               query_pre_attn_scalar=_pre_attn_scalar(c.query_scale), rope_local_base_freq=c.local_rope_theta,
               attention_bias=c.qkv_bias, final_logit_softcapping=None, attn_logit_softcapping=None)
    out.update(layer_types=types or ["full_attention"] * c.num_layers, sliding_window=c.sliding_window or None)
    return out
  out = dict(hidden_act=c.hidden_act if c.hidden_act == "silu" else "gelu_pytorch_tanh")
  if c.architecture == "llama":
    if c.qkv_bias != c.o_bias:
      raise ValueError("Llama checkpoints bias either all of q/k/v/o or none of them")
    out.update(attention_bias=c.qkv_bias, mlp_bias=False)
  elif c.architecture == "qwen2" and (not c.qkv_bias or c.o_bias):
    raise ValueError("Qwen2 checkpoints bias q/k/v and not o; set qkv_bias=True, o_bias=False")
  elif c.architecture in ("qwen3", "qwen3_moe"):
    out.update(attention_bias=c.qkv_bias)
  if types:
    out.update(use_sliding_window=True, sliding_window=c.sliding_window, layer_types=types,
               max_window_layers=c.layer_types.index("sliding"))
  if c.num_experts:
    out.update(num_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
               moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
               mlp_only_layers=list(c.dense_layers), decoder_sparse_step=c.sparse_step,
               router_aux_loss_coef=c.router_aux_loss_coef)
  return out


def _pre_attn_scalar(scale: float) -> float:
  value = scale ** -2
  return int(round(value)) if math.isclose(value, round(value), rel_tol=1e-6) else value


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The `config.json` dictionary that transformers reads back into the same model."""
  c = config
  arch = {v: k for k, v in ARCHITECTURES.items()}[c.architecture]
  out = dict(
      architectures=[arch], model_type=MODEL_TYPES[c.architecture], vocab_size=c.vocab_size,
      hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
      rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_embeddings,
      max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
      torch_dtype=c.param_dtype, bos_token_id=c.bos_token_id,
      eos_token_id=list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id)
  out.update(_family_out(c))
  if c.rope_scaling is not None:
    out["rope_scaling"] = _rope_out(c.rope_scaling)
  return out

