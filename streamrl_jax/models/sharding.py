"""Logical axis names -> mesh axes. One rules table shards the model on the sampler and trainer meshes.

Meshes use the axes ("data", "fsdp", "tensor"). A mesh axis that does not divide a dimension, is
absent from the mesh, or is already used by another dimension of the same array is dropped (that
dimension is replicated), so tiny test models shard on any mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: Mapping[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "expert": "fsdp",  # a mixture's experts (expert parallelism; the trainer names the axis: MeshConfig.expert_axis)
    "expert_mlp": None,  # an expert's own width: whole on the device holding the expert
    "expert_choice": None,  # the router's output: one logit per expert, replicated
}


def batch_axes(mesh: Mesh, rows: int) -> tuple[str, ...]:
  """The mesh axes a dimension of `rows` rows splits over: the logical rules' "batch" axes of size > 1, all of them
  or none (a split over some alone would leave the others' devices holding copies)."""
  axes = tuple(a for a in DEFAULT_RULES["batch"] if mesh.shape.get(a, 1) > 1)
  return axes if axes and rows % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def logical_spec(axes: tuple, shape: tuple, mesh: Mesh, rules: Mapping[str, MeshAxes] | None = None):
  """PartitionSpec for an array with logical `axes` and `shape` on `mesh`."""
  rules = DEFAULT_RULES if rules is None else rules
  used, spec = set(), []
  for name, dim in zip(axes, shape):
    if name is not None and name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; rules cover {sorted(rules)}")
    wanted = rules.get(name) if name is not None else None
    wanted = (wanted,) if isinstance(wanted, str) else tuple(wanted or ())
    chosen, size = [], 1
    for axis in wanted:
      n = mesh.shape.get(axis, 0)
      if n > 1 and axis not in used and dim % (size * n) == 0:
        chosen.append(axis)
        size *= n
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return PartitionSpec(*spec)


def logical_sharding(axes, shape, mesh: Mesh, rules=None) -> NamedSharding:
  return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules))


def state_shardings(state: nnx.State, mesh: Mesh, rules=None):
  """A pytree of NamedShardings matching `state` (every leaf must carry `logical_axes`)."""
  def one(variable):
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
      raise ValueError(f"parameter of shape {variable.shape} has no logical_axes metadata")
    return variable.replace(logical_sharding(axes, variable.shape, mesh, rules))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=None) -> nnx.Module:
  """A copy of `model` with every parameter placed on `mesh` by the rules."""
  graphdef, state = nnx.split(model)
  placed = jax.device_put(state, state_shardings(state, mesh, rules))
  return nnx.merge(graphdef, placed)
