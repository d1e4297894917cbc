"""A layer's gradient completed before the layer below's backward begins (`fenced`).

Left to itself, TPU's compiler keeps a layer's weight-gradient products and their reduce-scatters back, to overlap
them with the layers below, and every layer's activations they read stay live meanwhile: under `remat='layer'`,
Qwen3-8B's gradient call on a v6e chip held about 0.6 GiB a layer for one row of 5,120 tokens where the layer's
input, 40 MiB, is all it must keep (`streamrl plan`; docs/plans.md). The fence is an identity whose backward passes
a layer's input cotangent and its trained parameters' cotangents through one optimization barrier, so the layer below
sees its input cotangent only once this layer's gradient is complete.
"""

from __future__ import annotations

import jax
from flax import nnx


@jax.custom_vjp
def _fence(params, x):
  return params, x


def _fence_fwd(params, x):
  return (params, x), None


def _fence_bwd(_, cotangents):
  return jax.lax.optimization_barrier(cotangents)


_fence.defvjp(_fence_fwd, _fence_bwd)


def fenced(layer: nnx.Module, x: jax.Array, trained: type) -> tuple[nnx.Module, jax.Array]:
  """(`layer`, `x`) behind the fence: the variables of type `trained` (what the call differentiates: nnx.Param, or
  LoRA's nnx.LoRAParam) and `x` tied in the backward pass."""
  graphdef, params, rest = nnx.split(layer, trained, ...)
  params, x = _fence(params, x)
  return nnx.merge(graphdef, params, rest), x
