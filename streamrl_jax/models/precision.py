"""The sampler's weight precision: what the trainer's float32 weights become on their way to a sampler.

A version travels as a *wire* pytree `{"values": like params, "scales": {name: array}}`:

- `float32`: the weights as they are (`scales` empty);
- `bfloat16`: floating weights rounded to bfloat16 (half the bytes; the sampler computes in its activations'
  dtype with the rounded weights);
- `int8`: weight-only int8 with per-channel absmax scales (`qwix.quantize`), for every matrix that meets the
  hidden state (`embed` in its logical axes); norms and biases stay float32. A quarter of the bytes.

`encode` runs on the trainer's side of the transfer (fewer bytes move) or on the sampler's (`quantize_on`);
`decode` runs on the sampler mesh and gives the parameters the engine computes with (int8 dequantized to
float32 there: same numerics as an int8 weight-only kernel, not its memory). Scales are per output channel:
one per row of the embedding table (a row is what a lookup and a tied head read), one per output feature of
every projection.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from streamrl_jax import launch
from streamrl_jax.models.sharding import state_shardings
from streamrl_jax.pytrees import flatten_with_names

PRECISIONS = ("float32", "bfloat16", "int8")
QUANTIZE_ON = ("trainer", "sampler")


@dataclasses.dataclass(frozen=True)
class SamplerPrecision:
  """The sampler's weight precision and where the weights are reduced to it."""

  precision: str = "float32"
  quantize_on: str = "trainer"  # "trainer": fewer bytes move; "sampler": float32 moves, the sampler reduces

  def __post_init__(self):
    if self.precision not in PRECISIONS:
      raise ValueError(f"sampler precision {self.precision!r}; known: {list(PRECISIONS)}")
    if self.quantize_on not in QUANTIZE_ON:
      raise ValueError(f"quantize_on={self.quantize_on!r}; known: {list(QUANTIZE_ON)}")

  @property
  def on_trainer(self) -> SamplerPrecision:
    """What the trainer sends: this precision, or float32 when the sampler reduces."""
    return self if self.quantize_on == "trainer" else SamplerPrecision()


def channel_axes(logical_axes: tuple) -> tuple[int, ...] | None:
  """The axes with a scale each (the output channels) of a weight with these logical axes; None: not
  quantized (norms, biases: no `embed` axis, or a vector)."""
  if len(logical_axes) < 2 or "embed" not in logical_axes:
    return None
  if logical_axes[0] == "expert":  # a mixture's stacked experts: each expert's own channels
    return (0,) + tuple(a + 1 for a in channel_axes(logical_axes[1:]))
  if tuple(logical_axes) == ("vocab", "embed"):  # the embedding table: one scale per token row
    return (0,)
  if logical_axes[-1] == "embed":  # o_proj (heads, head_dim, embed), down_proj (mlp, embed)
    return (len(logical_axes) - 1,)
  return tuple(range(1, len(logical_axes)))  # q/k/v, gate/up, lm_head: every axis but the input `embed`


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def encode(params: nnx.State, precision: str) -> dict:
  """The wire pytree of `params` (an nnx.State whose variables carry `logical_axes`) at `precision`."""
  if precision not in PRECISIONS:
    raise ValueError(f"sampler precision {precision!r}; known: {list(PRECISIONS)}")
  floats = jnp.bfloat16 if precision == "bfloat16" else jnp.float32
  scales = {}

  def one(path, variable):
    value = variable[...]
    if not jnp.issubdtype(value.dtype, jnp.floating):
      return variable
    axes = channel_axes(tuple(variable.get_metadata().get("logical_axes") or ()))
    if precision != "int8" or axes is None:
      return variable.replace(value.astype(floats))
    q = qwix.quantize(value.astype(jnp.float32), jnp.int8, channelwise_axes=axes)
    scales[jax.tree_util.keystr(path)] = q.scale
    return variable.replace(q.qvalue)
  values = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)
  return {"values": values, "scales": scales}


def decode(wire: dict) -> nnx.State:
  """The parameters a sampler computes with: int8 values times their scales (float32), others as sent."""
  scales = wire["scales"]

  def one(path, variable):
    scale = scales.get(jax.tree_util.keystr(path))
    if scale is None:
      return variable
    return variable.replace(variable[...].astype(jnp.float32) * scale)
  return jax.tree_util.tree_map_with_path(one, wire["values"], is_leaf=_is_variable)


def wire_template(abstract: nnx.State, precision: str) -> dict:
  """The wire pytree's shapes and dtypes for parameters shaped like `abstract`."""
  return jax.eval_shape(lambda p: encode(p, precision), abstract)


def wire_shardings(template: dict, mesh, rules=None) -> dict:
  """For a wire template: values sharded like the parameters; scales (a few per output channel) replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return {"values": state_shardings(template["values"], mesh, rules),
          "scales": jax.tree.map(lambda _: replicated, template["scales"])}


_encode_jit = jax.jit(encode, static_argnums=1)


def to_wire(params: nnx.State, precision: SamplerPrecision) -> dict:
  """The trainer's half: what it sends of `params` (new arrays, so the trainer may donate `params` next;
  float32 sent as float32 is the parameters themselves, as every transport placed them before)."""
  sent = precision.on_trainer.precision
  if sent == "float32" and all(a.dtype == jnp.float32 for a in jax.tree.leaves(params)
                               if jnp.issubdtype(a.dtype, jnp.floating)):
    return {"values": params, "scales": {}}
  return launch.launcher(params)(_encode_jit, params, sent)


@dataclasses.dataclass(frozen=True)
class Landing:
  """The sampler's half for one model and mesh: the wire's template (shapes, dtypes) and shardings, and
  `finish(wire placed on the mesh) -> parameters` (dequantize; or reduce, when the sampler quantizes)."""

  template: dict
  shardings: dict
  finish: object


def landing(abstract: nnx.State, precision: SamplerPrecision, mesh, rules=None, *, base=None,
            lora_scale: float = 1.0) -> Landing:
  """The sampler's half of `precision` for parameters shaped like `abstract`, on `mesh`.

  With `base` (LoRA: a plain model's parameters), a version is the adapters (`abstract` their shapes), sent in
  float32: `finish` merges them into the base, placed on the mesh once (`lora.merge`), then reduces the merged
  weights to `precision`."""
  if base is not None:
    return _lora_landing(abstract, precision, mesh, rules, base, lora_scale)
  sent = precision.on_trainer.precision
  template = wire_template(abstract, sent)
  shardings = wire_shardings(template, mesh, rules)
  if precision.quantize_on == "sampler" and precision.precision != "float32":
    finish = launch.launcher(mesh).jit(lambda wire: decode(encode(decode(wire), precision.precision)))
  elif template["scales"]:
    finish = launch.launcher(mesh).jit(decode)
  else:
    def finish(wire):
      return wire["values"]
  return Landing(template, shardings, finish)


def _lora_landing(abstract, precision: SamplerPrecision, mesh, rules, base, scale: float) -> Landing:
  from streamrl_jax.models import lora

  template = wire_template(abstract, "float32")
  shardings = wire_shardings(template, mesh, rules)
  placed_base = launch.put(base, state_shardings(base, mesh, rules))

  def merged(base, wire):
    params = lora.merge(base, wire["values"], scale)
    return params if precision.precision == "float32" else decode(encode(params, precision.precision))
  merge_jit = launch.launcher(mesh).jit(merged)
  return Landing(template, shardings, lambda wire: merge_jit(placed_base, wire))


def wire_bytes(wire: dict) -> int:
  """Bytes a version moves at this precision."""
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in flatten_with_names(wire).values())
