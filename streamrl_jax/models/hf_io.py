"""Hugging Face checkpoints (config.json + safetensors, one file or sharded with an index), without torch.

One table, `tensor_layout`, names every Hugging Face tensor and where it lives in the NNX model;
loading and saving both read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.families import config_from_hf, config_to_hf
from streamrl_jax.models.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  hf_name: str
  path: tuple  # path of the nnx.Param in the model's state
  linear_in_dims: int = 0  # >0: a torch Linear weight [out, in] stored as [*in_dims, *out_dims]
  expert: int | None = None  # one expert's slice [expert] of a stacked parameter [experts, ...]


# a family's per-layer norms: Hugging Face name -> the model's norm
_NORMS = {"llama": {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"},
          "gemma3": {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                     "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}}


def tensor_layout(config: ModelConfig) -> list[TensorSpec]:
  specs = [TensorSpec("model.embed_tokens.weight", ("embed",)),
           TensorSpec("model.norm.weight", ("final_norm", "scale"))]
  if not config.tie_embeddings:
    specs.append(TensorSpec("lm_head.weight", ("lm_head",), 1))
  norms = _NORMS["gemma3" if config.sandwich_norms else "llama"]
  for i in range(config.num_layers):
    hf, me = f"model.layers.{i}", ("layers", i)
    specs += [TensorSpec(f"{hf}.{name}.weight", me + (ours, "scale")) for name, ours in norms.items()]
    specs.append(TensorSpec(f"{hf}.self_attn.o_proj.weight", me + ("attn", "o_proj"), 2))
    for name in ("q", "k", "v"):
      specs.append(TensorSpec(f"{hf}.self_attn.{name}_proj.weight", me + ("attn", f"{name}_proj"), 1))
      if config.qkv_bias:
        specs.append(TensorSpec(f"{hf}.self_attn.{name}_proj.bias", me + ("attn", f"{name}_bias")))
    if config.o_bias:
      specs.append(TensorSpec(f"{hf}.self_attn.o_proj.bias", me + ("attn", "o_bias")))
    if config.qk_norm:
      specs += [TensorSpec(f"{hf}.self_attn.{n}_norm.weight", me + ("attn", f"{n}_norm", "scale")) for n in "qk"]
    specs += _mlp_layout(config, i, hf, me)
  return specs


def _mlp_layout(config: ModelConfig, layer: int, hf: str, me: tuple) -> list[TensorSpec]:
  """A layer's MLP tensors: dense gate/up/down, or a mixture's router and every expert's three (stacked here)."""
  if not config.is_moe_layer(layer):
    return [TensorSpec(f"{hf}.mlp.{name}_proj.weight", me + ("mlp", f"{name}_proj"), 1) for name in ("gate", "up", "down")]
  specs = [TensorSpec(f"{hf}.mlp.gate.weight", me + ("mlp", "router"), 1)]
  for e in range(config.num_experts):
    specs += [TensorSpec(f"{hf}.mlp.experts.{e}.{name}_proj.weight", me + ("mlp", f"{name}_proj"), 1, e)
              for name in ("gate", "up", "down")]
  return specs


def _hf_shape(spec: TensorSpec, shape: tuple) -> tuple:
  if spec.expert is not None:
    shape = shape[1:]
  if spec.linear_in_dims:
    k = spec.linear_in_dims
    return (math.prod(shape[k:]), math.prod(shape[:k]))
  return (math.prod(shape),) if len(shape) > 1 and spec.hf_name.endswith(".bias") else tuple(shape)


def _to_model_layout(spec: TensorSpec, array: np.ndarray, shape: tuple) -> np.ndarray:
  shape = shape[1:] if spec.expert is not None else shape
  return (array.T if spec.linear_in_dims else array).reshape(shape)


def _to_hf_layout(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
  if spec.expert is not None:
    array = array[spec.expert]
  if spec.linear_in_dims:
    k = spec.linear_in_dims
    return np.ascontiguousarray(array.reshape(math.prod(array.shape[:k]), -1).T)
  return array.reshape(_hf_shape(spec, array.shape))


def _tensor_files(path: Path) -> dict[str, Path]:
  """Maps each tensor name to the safetensors file that holds it."""
  index = path / INDEX_FILE
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: path / file for name, file in weight_map.items()}
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  out = {}
  for file in files:
    with safe_open(file, framework="numpy") as f:
      out.update({name: file for name in f.keys()})
  return out


def read_hf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
  config_file = Path(path) / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{config_file} not found: a Hugging Face model directory needs config.json")
  return config_from_hf(json.loads(config_file.read_text()), **overrides)


def load_hf(path: str | os.PathLike, dtype=jnp.float32, *, compute_dtype: str | None = None, mesh=None, rules=None,
            **overrides) -> Transformer:
  """Reads a Hugging Face directory of a supported family (`models.families`) into a `Transformer` with parameters in `dtype`, computing in
  `compute_dtype` (default: `dtype`).

  With `mesh`, each tensor is placed straight into its sharding from the logical `rules`.
  `overrides` set other ModelConfig fields (e.g. `remat=True`).
  """
  path = Path(path)
  dtype_name = jnp.dtype(dtype).name
  config = read_hf_config(path, dtype=compute_dtype or dtype_name, param_dtype=dtype_name, **overrides)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  files = _tensor_files(path)
  specs = tensor_layout(config)
  _check_unexpected(files, specs, config, path)
  flat = dict(nnx.to_flat_state(abstract))
  stacked = {}  # a stacked parameter's experts, filled one by one (host memory) before it is placed
  with contextlib.ExitStack() as stack:
    handles = {}
    for spec in specs:
      if spec.hf_name not in files:
        raise KeyError(f"tensor {spec.hf_name!r} is missing from the checkpoint in {path}")
      file = files[spec.hf_name]
      if file not in handles:
        handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
      variable = flat[spec.path]
      array = handles[file].get_tensor(spec.hf_name)
      expected = _hf_shape(spec, variable.shape)
      if tuple(array.shape) != expected:
        raise ValueError(f"tensor {spec.hf_name!r} in {file.name} has shape {tuple(array.shape)}, "
                         f"expected {expected} from config.json")
      value = _to_model_layout(spec, array, variable.shape).astype(dtype)
      if spec.expert is not None:
        stacked.setdefault(spec.path, np.zeros(variable.shape, value.dtype))[spec.expert] = value
        if spec.expert < variable.shape[0] - 1:
          continue
        value = stacked.pop(spec.path)
      flat[spec.path] = variable.replace(_place(value, variable, mesh, rules))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(value: np.ndarray, variable, mesh, rules):
  if mesh is None:
    return jnp.asarray(value)
  from streamrl_jax.models.sharding import logical_sharding
  return jax.device_put(value, logical_sharding(variable.logical_axes, value.shape, mesh, rules))


def _check_unexpected(files: dict, specs: list[TensorSpec], config: ModelConfig, path: Path):
  known = {spec.hf_name for spec in specs}
  if config.tie_embeddings:
    known.add("lm_head.weight")  # some tied checkpoints store a copy; the embedding is used
  extra = sorted(n for n in files if n not in known and not n.endswith(IGNORED_SUFFIXES))
  if extra:
    raise ValueError(f"checkpoint in {path} has {len(extra)} tensors this config does not use "
                     f"(first: {extra[:5]}); is config.json right for these weights?")


def save_hf(model: Transformer, path: str | os.PathLike, *, max_shard_bytes: int = 4 << 30,
            dtype=None) -> Path:
  """Writes `model` as a Hugging Face directory (config.json, safetensors, index if sharded)."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  config = model.config
  if dtype is not None:
    config = dataclasses.replace(config, param_dtype=jnp.dtype(dtype).name)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  shards, current, size = [], {}, 0
  host = {}  # the parameter being written (a stacked one once for all its experts)
  for spec in tensor_layout(config):
    if spec.path not in host:
      host = {spec.path: np.asarray(jax.device_get(flat[spec.path][...])).astype(config.weight_dtype, copy=False)}
    array = _to_hf_layout(spec, host[spec.path])
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[spec.hf_name] = array
    size += array.nbytes
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, path / name, metadata={"format": "pt"})
    weight_map.update({tensor: name for tensor in shard})
  if len(shards) > 1:
    total = sum(a.nbytes for shard in shards for a in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
  (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
  return path
