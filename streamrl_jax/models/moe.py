"""A mixture of experts (Qwen3-MoE's): a softmax router over the experts, each token's top k, and the routed experts'
gated MLPs, computed for the routed (token, expert) pairs alone.

The pairs are sorted by expert and each expert's MLP multiplies only its own rows: on an accelerator with
`jax.lax.ragged_dot` (a grouped matmul); on a CPU, whose `ragged_dot` multiplies every row by every expert, as a loop
over blocks of one expert's rows (`grouped_blocks`). A decode step's few tokens thus read only the experts they were
routed to.

Routing replay: given the experts a sampler chose for each token (`routes`), the layer uses them instead of its own
top k; the weights are its own router's probabilities of those experts, so the router still learns. Every call
returns its own choices (what a sampler records, and what router agreement compares) and the load-balancing
statistics over the valid tokens.

Expert parallelism: with an `ExpertPlacement`, the experts are split over one mesh axis (`shard_map`): each device
takes the rows of every device on that axis, computes its own experts' pairs, and the outputs are summed back to
the rows' owners.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from streamrl_jax.models.compile_target import target_backend
from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.layers import _param, gate_activation, tokens_matmul


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
  """Experts split over `axis` of `mesh`; the rows of a call are split over `batch_axes` (static, hashable)."""

  mesh: Mesh
  axis: str
  batch_axes: tuple[str, ...] = ("data", "fsdp")


@flax.struct.dataclass
class RouterTrace:
  """What a mixture layer reports of one call: each token's chosen experts [B, T, k] (int32; its own top k, whether
  or not routes were replayed), and over the valid tokens the hits per expert `load` [E] (top-k choices counted)
  and the summed router probabilities `importance` [E]."""

  experts: jax.Array
  load: jax.Array
  importance: jax.Array


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(weights [N, k], experts [N, k], probs [N, E]) of router logits [N, E]: the softmax's top k (float32), their
  probabilities renormalised to sum to 1 when `normalize`."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  return _normalized(weights, normalize), experts.astype(jnp.int32), probs


def replayed(probs: jax.Array, experts: jax.Array, normalize: bool) -> jax.Array:
  """Weights [N, k] of given `experts` [N, k] under router probabilities `probs` [N, E] (routing replay)."""
  return _normalized(jnp.take_along_axis(probs, experts, axis=-1), normalize)


def _normalized(weights, normalize: bool):
  return weights / jnp.sum(weights, axis=-1, keepdims=True) if normalize else weights


def load_balancing_loss(load: jax.Array, importance: jax.Array, count: jax.Array) -> jax.Array:
  """Switch Transformer's auxiliary loss as transformers computes it for Qwen3-MoE, over every mixture layer's
  tokens together: E * sum_e (hits of e / tokens) * (mean probability of e), with `load` and `importance` [layers,
  E] summed over `count` valid tokens per layer. 1 when routing is uniform with k = 1, larger when it is skewed."""
  experts, tokens = load.shape[-1], jnp.maximum(count * load.shape[0], 1.0)
  return experts * jnp.sum((load.sum(0) / tokens) * (importance.sum(0) / tokens))


def expert_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: str) -> jax.Array:
  """One expert's gated MLP on rows x [n, H] (weights [H, I], [H, I], [I, H])."""
  return tokens_matmul(gate_activation(act)(tokens_matmul(x, gate)) * tokens_matmul(x, up), down)


def block_size(pairs: int, experts: int) -> int:
  """Rows of one block of `grouped_blocks`: the power of two nearest an expert's mean share of the pairs, at most
  64 (a decode step's few pairs: 1 or 2, each block a token's expert; a trainer call's thousands: 64)."""
  mean = max(pairs // max(experts, 1), 1)
  return min(1 << (mean.bit_length() - 1), 64)


def grouped_blocks(x, group: jax.Array, counts: jax.Array, weights: tuple, act: str, block: int) -> jax.Array:
  """The gated MLP of expert group[i] on each row x[i] ([P, H], rows sorted by group; counts [E] rows a group), as a
  loop over blocks of `block` rows of one expert. Each group starts a block, so at most P / block + E blocks are
  used; blocks past the last used one are skipped."""
  pairs, experts = x.shape[0], counts.shape[0]
  blocks = (pairs + min(experts, pairs) * (block - 1)) // block
  per = (counts + block - 1) // block
  first_block = jnp.cumsum(per) - per
  first_row = jnp.cumsum(counts) - counts
  rows = first_block[group] * block + jnp.arange(pairs, dtype=jnp.int32) - first_row[group]
  padded = jnp.zeros((blocks * block, x.shape[1]), x.dtype).at[rows].set(x)
  owner = jnp.minimum(jnp.searchsorted(jnp.cumsum(per), jnp.arange(blocks), side="right"), experts - 1)
  used = jnp.arange(blocks) < jnp.sum(per)
  gate, up, down = weights

  def one(args):
    xb, e, live = args
    return jax.lax.cond(live, lambda: expert_ffn(xb, gate[e], up[e], down[e], act).astype(xb.dtype),
                        lambda: jnp.zeros_like(xb))
  out = jax.lax.map(one, (padded.reshape(blocks, block, -1), owner.astype(jnp.int32), used))
  return out.reshape(blocks * block, -1)[rows]


def grouped_ragged(x, counts: jax.Array, weights: tuple, act: str) -> jax.Array:
  """`grouped_blocks` through `jax.lax.ragged_dot` (a grouped matmul on accelerators)."""
  gate, up, down = weights
  dt = x.dtype
  h = gate_activation(act)(jax.lax.ragged_dot(x, gate.astype(dt), counts)) * jax.lax.ragged_dot(x, up.astype(dt), counts)
  return jax.lax.ragged_dot(h, down.astype(dt), counts)


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, expert_weights: tuple, act: str,
                   method: str = "auto") -> jax.Array:
  """sum_j weights[n, j] * MLP_{experts[n, j]}(x[n]) for rows x [N, H]; an expert id outside [0, E) (another
  device's, under expert parallelism) contributes nothing. `method`: "blocks", "ragged", or "auto" (blocks on a
  CPU, ragged elsewhere)."""
  n, k = experts.shape
  num = expert_weights[0].shape[0]
  flat = experts.reshape(-1)
  local = (flat >= 0) & (flat < num)
  key = jnp.where(local, flat, num)  # another device's pairs sort last, in no group
  order = jnp.argsort(key, stable=True)
  group = key[order]
  counts = jnp.bincount(key, length=num + 1)[:num].astype(jnp.int32)
  rows = x[order // k]
  if method == "auto":
    method = "blocks" if target_backend() == "cpu" else "ragged"
  if method == "blocks":
    out = grouped_blocks(rows, jnp.minimum(group, num - 1), counts, expert_weights, act, block_size(n * k, num))
  else:
    out = grouped_ragged(rows, counts, expert_weights, act)
  pair_out = jnp.zeros_like(out).at[order].set(jnp.where(local[order][:, None], out, 0))
  mixed = pair_out.reshape(n, k, -1).astype(jnp.float32) * weights[..., None].astype(jnp.float32)
  return mixed.sum(axis=1).astype(x.dtype)


def _sharded(x, experts, weights, expert_weights, act, placement: ExpertPlacement):
  """`routed_experts` with the experts split over `placement.axis` (rows x [B, T, H] split over its batch axes)."""
  axis, mesh = placement.axis, placement.mesh
  batch = tuple(a for a in placement.batch_axes if mesh.shape.get(a, 1) > 1) or None
  gathers = batch is not None and axis in batch
  rows = PartitionSpec(batch)

  def local(x, experts, weights, gate, up, down):
    if gathers:
      x, experts, weights = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (x, experts, weights))
    offset = jax.lax.axis_index(axis) * gate.shape[0]
    b, t, h = x.shape
    out = routed_experts(x.reshape(b * t, h), (experts - offset).reshape(b * t, -1), weights.reshape(b * t, -1),
                         (gate, up, down), act).reshape(b, t, h)
    if gathers:
      return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
    return jax.lax.psum(out, axis)
  spec = PartitionSpec(axis)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, spec, spec, spec), out_specs=rows,
                       check_vma=False)(x, experts, weights, *expert_weights)


class MoeMLP(nnx.Module):
  """A sparse layer's router and experts: gate and up [E, H, I], down [E, I, H], the router [H, E]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    self.k, self.normalize, self.act = config.experts_per_token, config.norm_topk_prob, config.hidden_act
    self.router = _param(rngs, config, (h, e), ("embed", "expert_choice"))
    self.gate_proj = _param(rngs, config, (e, h, i), ("expert", "embed", "expert_mlp"))
    self.up_proj = _param(rngs, config, (e, h, i), ("expert", "embed", "expert_mlp"))
    self.down_proj = _param(rngs, config, (e, i, h), ("expert", "expert_mlp", "embed"))

  def __call__(self, x: jax.Array, valid: jax.Array | None = None, routes: jax.Array | None = None,
               placement: ExpertPlacement | None = None) -> tuple[jax.Array, RouterTrace]:
    """x [B, T, H] -> (output [B, T, H], trace). `valid` [B, T]: the tokens the load statistics count (default:
    all); `routes` [B, T, k]: experts to use instead of the router's top k (replay; a token of -1s: its own)."""
    b, t, h = x.shape
    logits = tokens_matmul(x, self.router[...]).reshape(b * t, -1)
    weights, chosen, probs = route(logits, self.k, self.normalize)
    experts = chosen
    if routes is not None:  # a token whose routes were not recorded (-1) goes where the router sends it
      given = routes.reshape(b * t, self.k).astype(jnp.int32)
      experts = jnp.where(jnp.all(given >= 0, axis=-1, keepdims=True), given, chosen)
      weights = replayed(probs, experts, self.normalize)
    weights = weights.astype(x.dtype)
    expert_weights = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
    if placement is not None and placement.mesh.shape.get(placement.axis, 1) > 1:
      out = _sharded(x, experts.reshape(b, t, -1), weights.reshape(b, t, -1), expert_weights, self.act, placement)
    else:
      out = routed_experts(x.reshape(b * t, h), experts, weights, expert_weights, self.act).reshape(b, t, h)
    mask = jnp.ones((b * t,), jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
    hits = jax.nn.one_hot(chosen, probs.shape[-1], dtype=jnp.float32).sum(axis=1)
    trace = RouterTrace(experts=chosen.reshape(b, t, -1), load=jax.lax.stop_gradient(mask @ hits),
                        importance=mask @ probs)
    return out, trace

