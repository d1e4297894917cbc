"""Low-rank adapters (LoRA) on the decoder's projections: trained alone over a frozen base, merged for sampling.

A projection `y = x @ W` with an adapter computes `y = x @ W + scale * (x @ A) @ B`, A [in, rank], B [rank, out],
`scale = alpha / rank`; B starts at zero (the adapted model starts as the base). This is our own small module,
not qwix's LoRA: qwix adapts the `dot_general`s it intercepts, and this model's projections are reshaped 3-D
kernels read through one helper (`layers.tokens_matmul`) whose layout the PEFT format must match exactly; an
adapter that is a plain NNX attribute of the module it adapts keeps the state an explicit pytree we can name.

- `attach(model, config, key)` adds the adapters (`nnx.LoRAParam` variables) to a model in place;
  `split(model)` gives (graphdef, adapters, base), the base's paths those of the plain model.
- `merge(base, adapters, scale)` is the dense model a sampler decodes with: W + scale * A @ B per target, once per
  weight version, so decode pays nothing.
- `check(config, model_config)` refuses a target the model lacks, a rank above a projection's smaller side.

Adapters' variables carry no sharding (they are replicated: rank x hidden is small).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.config_types import ConfigError
from streamrl_jax.models.config import ModelConfig

# Logical target name -> (the module in a decoder layer, the projection's attribute). Every Llama/Qwen2 linear.
TARGETS = {"q": ("attn", "q_proj"), "k": ("attn", "k_proj"), "v": ("attn", "v_proj"), "o": ("attn", "o_proj"),
           "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"), "down": ("mlp", "down_proj")}
SUFFIX = "_lora"  # the adapter of `q_proj` is the module's attribute `q_proj_lora`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters: trained alone (the base frozen), synced alone, saved in the PEFT format."""

  rank: int = 0  # the adapters' rank; 0: off (every weight trains and syncs)
  alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
  targets: tuple = ("q", "k", "v", "o", "gate", "up", "down")  # projections adapted: q, k, v, o, gate, up, down
  dropout: float = 0.0  # dropout on the adapters' input: only 0 is supported
  init_from: str = ""  # a PEFT adapter directory to start from (adapter_config.json + adapter_model.safetensors)
  seed: int = 0  # seeds the adapters' A matrices (B starts at zero)

  def __post_init__(self):
    if self.rank < 0:
      raise ConfigError(f"LoraConfig.rank = {self.rank}: expected >= 0 (0: off)")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown:
      raise ConfigError(f"LoraConfig.targets: unknown {unknown[0]!r}; known: {', '.join(TARGETS)}")
    if self.rank and not self.targets:
      raise ConfigError("LoraConfig.targets is empty: name at least one projection (q, k, v, o, gate, up, down)")
    if self.dropout != 0.0:
      raise ConfigError(f"LoraConfig.dropout = {self.dropout}: only 0 is supported (RL post-training does not "
                        "need it; an imported adapter's dropout is ignored)")
    if self.rank and self.alpha <= 0:
      raise ConfigError(f"LoraConfig.alpha = {self.alpha}: expected > 0")

  @property
  def enabled(self) -> bool:
    """LoRA is on: a rank, or an adapter to start from (whose rank `peft_io.resolve` reads)."""
    return self.rank > 0 or bool(self.init_from)

  @property
  def scale(self) -> float:
    if not self.rank:
      raise ValueError("LoraConfig.scale of rank 0: resolve an init_from adapter first (peft_io.resolve)")
    return self.alpha / self.rank


def projection_dims(model_config: ModelConfig, target: str) -> tuple[int, int]:
  """(in, out) of a target projection as a 2-D matrix."""
  c = model_config
  return {"q": (c.hidden_size, c.num_heads * c.head_dim), "k": (c.hidden_size, c.num_kv_heads * c.head_dim),
          "v": (c.hidden_size, c.num_kv_heads * c.head_dim), "o": (c.num_heads * c.head_dim, c.hidden_size),
          "gate": (c.hidden_size, c.intermediate_size), "up": (c.hidden_size, c.intermediate_size),
          "down": (c.intermediate_size, c.hidden_size)}[target]


def adapter_param_count(config: LoraConfig, model_config: ModelConfig) -> int:
  """Parameters of the adapters (rank x (in + out) per target per layer)."""
  per_layer = sum(config.rank * sum(projection_dims(model_config, t)) for t in config.targets)
  return per_layer * model_config.num_layers


def check(config: LoraConfig, model_config: ModelConfig) -> None:
  """Refuses a rank larger than a target projection's smaller side, and an MLP target in a mixture of experts (one
  line naming it)."""
  experts = [t for t in config.targets if TARGETS[t][0] == "mlp"] if model_config.num_experts else []
  if experts:
    raise ConfigError(f"LoraConfig.targets: {experts[0]!r} in a mixture of experts ({model_config.architecture}): "
                      "adapters on experts are not implemented; adapt the attention (q, k, v, o)")
  for target in config.targets:
    dims = projection_dims(model_config, target)
    if config.rank > min(dims):
      raise ConfigError(f"LoraConfig.rank = {config.rank} is larger than projection {target!r}'s smaller side "
                        f"({dims[0]} x {dims[1]})")


class Adapter(nnx.Module):
  """One projection's adapter: `scale * (x @ a) @ b`."""

  def __init__(self, a: jax.Array, b: jax.Array, scale: float):
    self.a = nnx.LoRAParam(a, logical_axes=(None, None))
    self.b = nnx.LoRAParam(b, logical_axes=(None, None))
    self.scale = scale

  def __call__(self, x: jax.Array) -> jax.Array:
    from streamrl_jax.models.layers import tokens_matmul
    return tokens_matmul(tokens_matmul(x, self.a[...]), self.b[...]) * self.scale


def initial_arrays(config: LoraConfig, model_config: ModelConfig) -> dict:
  """{(layer, target): (A, B)}: A uniform in +-1/sqrt(in) (PEFT's default), B zero (numpy, float32)."""
  rng = np.random.default_rng(config.seed)
  out = {}
  for layer in range(model_config.num_layers):
    for target in config.targets:
      d_in, d_out = projection_dims(model_config, target)
      bound = 1.0 / math.sqrt(d_in)
      out[layer, target] = (rng.uniform(-bound, bound, (d_in, config.rank)).astype(np.float32),
                            np.zeros((config.rank, d_out), np.float32))
  return out


def attach(model, config: LoraConfig, arrays: dict | None = None):
  """Adds an adapter to every target projection of `model` (in place; returns it). `arrays`
  {(layer, target): (A, B)} as `initial_arrays` gives (its default) or a PEFT directory does (`peft_io`)."""
  check(config, model.config)
  arrays = initial_arrays(config, model.config) if arrays is None else arrays
  for (layer, target), (a, b) in arrays.items():
    module, name = TARGETS[target]
    parent = getattr(model.layers[layer], module)
    setattr(parent, name + SUFFIX, Adapter(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), config.scale))
  return model


def split(model):
  """(graphdef, adapters, base) of a model with adapters; the base's paths are the plain model's."""
  return nnx.split(model, nnx.LoRAParam, ...)


def adapt(graphdef, params, config: LoraConfig, arrays: dict | None = None):
  """(graphdef with adapters, adapters, base) for a plain model's (graphdef, params): adapters from `arrays`
  ({(layer, target): (A, B)}, e.g. a PEFT directory's) or fresh (`initial_arrays`); the base is `params` itself,
  not a copy."""
  return split(attach(nnx.merge(graphdef, params), config, arrays))


def adapter_shapes(graphdef, abstract, config: LoraConfig):
  """The adapters' shapes and dtypes (no values) for a plain model's (graphdef, abstract parameters)."""
  return jax.eval_shape(lambda p: adapt(graphdef, p, config)[1], abstract)


def adapter_arrays(adapters) -> dict:
  """{(layer, target): (A, B)} of an adapters state (the inverse of `attach`'s `arrays`)."""
  by_name = {f"{module}.{name}": target for target, (module, name) in TARGETS.items()}
  pairs: dict = {}
  for path, variable in nnx.to_flat_state(adapters):
    _, layer, module, attribute, which = path
    target = by_name[f"{module}.{attribute.removesuffix(SUFFIX)}"]
    pairs.setdefault((int(layer), target), {})[which] = variable[...] if isinstance(variable, nnx.Variable) else variable
  return {key: (ab["a"], ab["b"]) for key, ab in pairs.items()}


def merge(base, adapters, scale: float):
  """The dense parameters W + scale * A @ B (W's shape and dtype) of every adapted projection; the others as
  they are. `base` a plain model's parameters (nnx.State), `adapters` what `split` gives (traceable) or
  {(layer, target): (A, B)} (`adapter_arrays`, `peft_io.load_adapter`)."""
  deltas = {}
  pairs = adapters if isinstance(adapters, dict) and not isinstance(adapters, nnx.State) else adapter_arrays(adapters)
  for (layer, target), (a, b) in pairs.items():
    module, name = TARGETS[target]
    deltas[("layers", layer, module, name)] = (a, b)

  def one(path, variable):
    key = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
    if key not in deltas:
      return variable
    a, b = deltas[key]
    w = variable[...]
    delta = (jnp.asarray(a, jnp.float32) @ jnp.asarray(b, jnp.float32)) * scale
    return variable.replace((w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype))
  return jax.tree_util.tree_map_with_path(one, base, is_leaf=lambda x: isinstance(x, nnx.Variable))


def adapter_bytes(adapters) -> int:
  """Bytes of an adapters state (what a weight version moves with LoRA)."""
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters))
