"""Where a trainer call's activations live on its mesh (`ActivationLayout`): each row whole on the devices of its batch
shard. The model states it after the embedding and after every layer, so that GSPMD keeps the rows split and gathers
each layer's FSDP-sharded weights; left to itself it split the hidden axis like the weights' instead and all-reduced
every row's activations on every device (a [rows, T, mlp] array a matmul, seen in a plan's HLO). The layout also
carries the attention kernel, if the call uses one (`models.fused_attention`)."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.models.fused_attention import AttentionKernel
from streamrl_jax.models.sharding import batch_axes


@dataclasses.dataclass(frozen=True)
class ActivationLayout:
  """A trainer call's mesh (its batch axes split the rows) and its attention kernel (None: XLA's attention)."""

  mesh: Mesh
  kernel: AttentionKernel | None = None
  trained: type | None = None  # the variables the call differentiates (nnx.Param; LoRA's nnx.LoRAParam): each layer's
  # gradient of them is complete before the layer below's backward begins (`models.gradient_fence`); None: no fence

  def rows(self, x: jax.Array) -> jax.Array:
    """`x` [rows, ...] constrained to its rows split over the mesh's batch axes, where they divide them."""
    axes = batch_axes(self.mesh, x.shape[0])
    if not axes:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(axes)))
