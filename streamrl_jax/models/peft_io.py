"""LoRA adapters in the Hugging Face PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

A tensor is `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [rank, in] (our A transposed) and
`...lora_B.weight` [out, rank] (our B transposed); the scale is `lora_alpha / r`. `load_adapter` refuses, in one
line naming the file and the key, what this cannot honour: DoRA, rsLoRA, per-module ranks or alphas, biases,
extra trained modules, a subset of layers, tensors whose shapes or names do not fit the model, another base.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from streamrl_jax.config_types import ConfigError
from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.lora import TARGETS, LoraConfig, projection_dims

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
HF_MODULE = {"attn": "self_attn", "mlp": "mlp"}
# PEFT options whose only value this honours (anything else is refused).
REQUIRED = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none"}
EMPTY = ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern", "layers_pattern")


def tensor_name(layer: int, target: str, which: str) -> str:
  module, name = TARGETS[target]
  return f"{PREFIX}.{layer}.{HF_MODULE[module]}.{name}.lora_{which}.weight"


def save_adapter(directory: str | Path, arrays: dict, config: LoraConfig, base_name: str) -> Path:
  """Writes {(layer, target): (A, B)} (see `lora.adapter_arrays`) as a PEFT adapter directory."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for (layer, target), (a, b) in sorted(arrays.items()):
    tensors[tensor_name(layer, target, "A")] = np.ascontiguousarray(np.asarray(a, np.float32).T)
    tensors[tensor_name(layer, target, "B")] = np.ascontiguousarray(np.asarray(b, np.float32).T)
  save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
  targets = sorted({TARGETS[t][1] for _, t in arrays})
  meta = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_name, r=config.rank,
              lora_alpha=config.alpha, lora_dropout=0.0, target_modules=targets, bias="none", fan_in_fan_out=False,
              use_rslora=False, use_dora=False, init_lora_weights=True, inference_mode=True, modules_to_save=None,
              layers_to_transform=None, layers_pattern=None, rank_pattern={}, alpha_pattern={})
  (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
  return directory


def same_base(a: str, b: str) -> bool:
  """Whether two base names (a Hub id, a catalog name, a directory or file) may name the same model: an empty
  name, or a local path (its name says nothing: the tensor shapes are checked instead), matches anything; else
  the names or their last parts are equal, case aside."""
  if not a or not b or any(Path(x).expanduser().exists() for x in (a, b)):
    return True
  last = lambda s: s.rstrip("/").rsplit("/", 1)[-1].lower()  # noqa: E731
  return a == b or last(a) == last(b)


def load_adapter(directory: str | Path, model_config: ModelConfig, base_name: str = "") -> tuple[LoraConfig, dict]:
  """(LoraConfig, {(layer, target): (A, B)}) of a PEFT adapter directory for this model; every mismatch is a
  `ConfigError` naming the file and what differs."""
  directory = Path(directory)
  config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
  for path in (config_path, weights_path):
    if not path.is_file():
      raise ConfigError(f"{directory}: not a PEFT adapter directory ({path.name} is missing)")
  rank, alpha = _adapter_meta(config_path, base_name)
  arrays = _adapter_arrays(weights_path, model_config, rank)
  targets = sorted({t for _, t in arrays}, key=list(TARGETS).index)
  for layer in range(model_config.num_layers):
    for target in targets:
      if set(arrays.get((layer, target), ())) != {"A", "B"}:
        raise ConfigError(f"{weights_path}: layer {layer}'s {TARGETS[target][1]} lacks its lora_A or lora_B "
                          "(adapters on every layer only)")
  if not arrays:
    raise ConfigError(f"{weights_path}: no LoRA tensors")
  config = LoraConfig(rank=rank, alpha=float(alpha), targets=tuple(targets), init_from=str(directory))
  return config, {key: (ab["A"], ab["B"]) for key, ab in arrays.items()}


def _adapter_meta(config_path: Path, base_name: str) -> tuple[int, float]:
  """(rank, alpha) of an adapter_config.json that this project can load for the base `base_name`."""
  try:
    meta = json.loads(config_path.read_text())
  except json.JSONDecodeError as err:
    raise ConfigError(f"{config_path}: not valid JSON ({err})") from None
  for key, wanted in REQUIRED.items():
    if meta.get(key, wanted) != wanted:
      raise ConfigError(f"{config_path}: {key} = {meta[key]!r} is not supported (only {wanted!r})")
  for key in EMPTY:
    if meta.get(key):
      raise ConfigError(f"{config_path}: {key} = {meta[key]!r} is not supported (adapters on every layer's "
                        "projections only)")
  if not same_base(meta.get("base_model_name_or_path") or "", base_name):
    raise ConfigError(f"{config_path}: the adapter is for base {meta['base_model_name_or_path']!r}, this run's model "
                      f"is {base_name!r}")
  rank, alpha = meta.get("r"), meta.get("lora_alpha")
  if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
    raise ConfigError(f"{config_path}: r = {rank!r}, lora_alpha = {alpha!r}: expected a positive int and a number")
  return rank, alpha


def _adapter_arrays(weights_path: Path, model_config: ModelConfig, rank: int) -> dict:
  """{(layer, target): {"A": [d_in, rank], "B": [rank, d_out]}} of an adapter's safetensors, each name and shape
  checked against this model."""
  by_name = {name: target for target, (_, name) in TARGETS.items()}
  arrays: dict = {}
  for name, value in load_file(str(weights_path)).items():
    parts = name.split(".")
    ok = (name.startswith(PREFIX + ".") and len(parts) == 9 and parts[4].isdigit() and parts[6] in by_name
          and parts[7] in ("lora_A", "lora_B") and parts[8] == "weight")
    if not ok:
      raise ConfigError(f"{weights_path}: tensor {name!r} is not a LoRA A/B weight of a decoder projection")
    layer, target, which = int(parts[4]), by_name[parts[6]], parts[7][-1]
    if layer >= model_config.num_layers:
      raise ConfigError(f"{weights_path}: tensor {name!r}: the model has {model_config.num_layers} layers")
    d_in, d_out = projection_dims(model_config, target)
    wanted = (rank, d_in) if which == "A" else (d_out, rank)
    if tuple(value.shape) != wanted:
      raise ConfigError(f"{weights_path}: tensor {name!r} has shape {tuple(value.shape)}, this model's is {wanted} "
                        "(an adapter for another base?)")
    arrays.setdefault((layer, target), {})[which] = np.asarray(value, np.float32).T
  return arrays


def resolve(config: LoraConfig, model_config: ModelConfig, base_name: str = "", read: bool = True) -> LoraConfig:
  """`config` with an `init_from` adapter's rank, alpha and targets where `LoraConfig.rank` is 0 (not set); where
  it is set, the adapter must agree (checked when `read`: a remote sampler, which never reads the directory, passes
  False). The adapter is checked against the base (`load_adapter`). Without `init_from`, `config` as it is."""
  if not config.init_from or (config.rank and not read):
    return config
  loaded, _ = load_adapter(config.init_from, model_config, base_name)
  if not config.rank:
    return dataclasses.replace(config, rank=loaded.rank, alpha=loaded.alpha, targets=loaded.targets)
  check_matches(config, loaded)
  return config


def check_matches(config: LoraConfig, loaded: LoraConfig) -> None:
  """An adapter read from `config.init_from` has the rank, alpha and targets `config` says, or a one-line error."""
  if (loaded.rank, loaded.alpha, set(loaded.targets)) != (config.rank, config.alpha, set(config.targets)):
    raise ConfigError(f"LoraConfig.init_from = {config.init_from!r} holds rank {loaded.rank}, alpha {loaded.alpha}, "
                      f"targets {list(loaded.targets)}; LoraConfig says rank {config.rank}, alpha {config.alpha}, "
                      f"targets {list(config.targets)} (leave LoraConfig.rank unset to take the adapter's)")
