"""The one decoder-only transformer of every family (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3) as a Flax NNX module.

`model(tokens)` gives logits for a batch; `model.forward_with_cache(tokens, cache)` runs a chunk (a prefill or one
decode step) against a `KVCache` and returns `(logits, new_cache)`. A family is switches of `ModelConfig`: q/k norms,
Gemma's sandwich norms and scaled embeddings, sliding-window layers (each layer masks by its own window), and
mixture-of-experts layers (`models.moe`), whose routing a call may replay and whose choices it reports.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.activation_layout import ActivationLayout
from streamrl_jax.models.fused_attention import SegmentMask
from streamrl_jax.models.gradient_fence import fenced
from streamrl_jax.models.kv_cache import ContiguousLayer, KVCache
from streamrl_jax.models.layers import MLP, Attention, RMSNorm, _param, take_rows
from streamrl_jax.models.moe import ExpertPlacement, MoeMLP, RouterTrace
from streamrl_jax.models.paged_cache import PagedLayer, PagePool, chunk_mask


def packed_positions(segment_ids: jax.Array) -> jax.Array:
  """Each token's position within its segment [B, T]: 0 where a segment starts (its id differs from the
  token before), counting up to the segment's end."""
  steps = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  return steps - jax.lax.cummax(jnp.where(starts, steps, 0), axis=1)


@flax.struct.dataclass
class LayerRouting:
  """What a sparse layer's call takes besides its input: the tokens its load statistics count [B, T], the experts
  to replay [B, T, k] (None: its own top k), and where its experts live (None: all on this device)."""

  valid: jax.Array | None = None
  routes: jax.Array | None = None
  placement: ExpertPlacement | None = flax.struct.field(pytree_node=False, default=None)


@dataclasses.dataclass(frozen=True)
class Routing:
  """A call's mixture options: `routes` [B, T, sparse layers, k] to replay (None: the router's own choices) and the
  experts' `placement` (expert parallelism)."""

  routes: jax.Array | None = None
  placement: ExpertPlacement | None = None

  def layer(self, index: int, valid) -> LayerRouting:
    return LayerRouting(valid, None if self.routes is None else self.routes[:, :, index], self.placement)


class DecoderLayer(nnx.Module):
  """Pre-norm attention and MLP (a mixture of experts in a sparse layer), each with a norm on its output too where the
  family has them (Gemma's sandwich norms)."""

  def __init__(self, config: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs):
    self.sparse, self.sandwich = config.is_moe_layer(layer), config.sandwich_norms
    self.attn_norm = RMSNorm(config)
    self.attn = Attention(config, layer, rngs=rngs)
    self.mlp_norm = RMSNorm(config)
    self.mlp = MoeMLP(config, rngs=rngs) if self.sparse else MLP(config, rngs=rngs)
    if self.sandwich:
      self.attn_post_norm, self.mlp_post_norm = RMSNorm(config), RMSNorm(config)

  def __call__(self, x, positions, mask, kv_cache=None, routing: LayerRouting | None = None):
    """(x, kv_cache, trace): `routing` carries a sparse layer's valid tokens, replayed routes and placement; `trace`
    is its `RouterTrace` (None in a dense layer)."""
    h, kv_cache = self.attn(self.attn_norm(x), positions, mask, kv_cache)
    x = x + (self.attn_post_norm(h) if self.sandwich else h)
    h, trace = self.mlp_norm(x), None
    if self.sparse:
      routing = routing or LayerRouting()
      h, trace = self.mlp(h, routing.valid, routing.routes, routing.placement)
    else:
      h = self.mlp(h)
    return x + (self.mlp_post_norm(h) if self.sandwich else h), kv_cache, trace


def _run_layer(layer, x, positions, mask, kv_cache, routing):
  return layer(x, positions, mask, kv_cache, routing)


# ModelConfig.remat -> how a layer runs under autodiff (the routing options are static: placement and the tuple). A
# layer changes no state of its own, so none is written back (`graph_updates=False`): with LoRA's adapters merged over
# a frozen base inside the trainer's jit, writing it back raised flax's TraceContextError (found by `streamrl plan`)
_LAYER_RUNS = {"none": _run_layer, "layer": nnx.remat(_run_layer, graph_updates=False),
               "dots": nnx.remat(_run_layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                 graph_updates=False)}


def stack_traces(traces: list[RouterTrace]) -> RouterTrace | None:
  """Per sparse layer traces as one: experts [B, T, layers, k], load and importance [layers, E]."""
  if not traces:
    return None
  return RouterTrace(experts=jnp.stack([t.experts for t in traces], axis=2),
                     load=jnp.stack([t.load for t in traces]), importance=jnp.stack([t.importance for t in traces]))


def window_masks(attend, query_positions, key_positions, windows) -> dict:
  """{window: mask} for each distinct window of the layers (None: `attend` itself): a query at position p sees a
  key at position q only when p - q < window. query_positions [B, T], key_positions [B or 1, S]."""
  masks = {None: attend}
  for window in sorted({w for w in windows if w is not None}):
    near = (query_positions[:, :, None] - key_positions[:, None, :]) < window
    masks[window] = attend & near
  return masks


class Transformer(nnx.Module):
  """Token embeddings, `num_layers` pre-norm decoder layers, final norm, LM head (or tied embeddings)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = _param(rngs, config, (config.vocab_size, config.hidden_size), ("vocab", "embed"))
    self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config)
    if not config.tie_embeddings:
      self.lm_head = _param(rngs, config, (config.hidden_size, config.vocab_size), ("embed", "vocab"))

  def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, vocab] (float32) for int tokens [B, T]; `attention_mask` [B, T] marks real tokens
    (left or right padding); positions count real tokens only. `segment_ids` [B, T] (packed rows: samples
    end to end, 1, 2, ... per row, 0 for padding) keeps each sample to itself: a token attends only within
    its segment, and positions restart at each segment."""
    return self.head_logits(self.hidden_states(tokens, attention_mask, segment_ids))

  def hidden_states(self, tokens: jax.Array, attention_mask: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, remat: str | None = None) -> jax.Array:
    """Final-norm hidden states [B, T, hidden] (what the LM head, a value head or a ranker reads). `remat`
    replaces `config.remat` for this call (the trainer's own policy)."""
    return self.hidden_and_routing(tokens, attention_mask, segment_ids, remat)[0]

  def hidden_and_routing(self, tokens: jax.Array, attention_mask: jax.Array | None = None,
                         segment_ids: jax.Array | None = None, remat: str | None = None,
                         routing: Routing = Routing(),
                         layout: ActivationLayout | None = None) -> tuple[jax.Array, RouterTrace | None]:
    """`hidden_states` and the mixture layers' `RouterTrace` (None without experts), under `routing` (replayed
    routes [B, T, sparse layers, k], the experts' placement); a trainer call's `layout` keeps each row on its batch
    shard, and with its kernel attention is the fused kernel's (`models.fused_attention`: segments and windows, no
    [T, T] mask built)."""
    mask = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    positions = (jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0) if segment_ids is None
                 else packed_positions(segment_ids))
    if layout is not None and layout.kernel is not None:  # a token sees its segment alone: padding (0) apart
      segments = mask.astype(jnp.int32) if segment_ids is None else jnp.where(mask, segment_ids, 0)
      attention = (SegmentMask(segments, None, layout.kernel), positions)
    else:
      steps = jnp.arange(tokens.shape[1])
      attend = mask[:, None, :] & (steps[None, None, :] <= steps[None, :, None])
      if segment_ids is not None:
        attend = attend & (segment_ids[:, None, :] == segment_ids[:, :, None])
      attention = (attend, positions)
    hidden, _, trace = self._trunk(tokens, positions, attention, None, remat, routing, mask, layout)
    return hidden, trace

  def head_weights(self) -> jax.Array:
    """The LM head as [hidden, vocab] (the embeddings transposed when tied)."""
    return self.embed[...].T if self.config.tie_embeddings else self.lm_head[...]

  def output_weights(self) -> tuple[jax.Array, int]:
    """The LM head as stored, and its vocabulary axis: the embeddings [vocab, hidden] (0) when tied, else the head
    [hidden, vocab] (1). Chunked log-probabilities read it so, without a transposed copy."""
    return (self.embed[...], 0) if self.config.tie_embeddings else (self.lm_head[...], 1)

  def forward_with_cache(self, tokens, cache: KVCache, attention_mask=None, window: int | None = None,
                         logits_at: jax.Array | None = None, with_routes: bool = False):
    """Runs tokens [B, T] after what `cache` holds; returns (logits [B, T, vocab], updated cache), and with
    `with_routes` the experts each token was routed to [B, T, sparse layers, k] (int32) as a third value.

    `window` (static) limits attention to the first `window` cache entries; every row's valid
    entries, this chunk's included, must lie below it. Decoding then reads only that much cache.
    `logits_at` [B] (int): the logits of that position of each row alone, [B, 1, vocab] (a prefill needs
    the last prompt token's; the LM head over every position would be a fifth of a small model's work).
    """
    mask = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    positions, write_index, attend, bookkeeping = cache.chunk_layout(mask)
    keys_at = bookkeeping["positions"]
    if window is not None:
      attend, keys_at = attend[..., :window], keys_at[:, :window]
    layers = [ContiguousLayer(k, v, write_index) for k, v in zip(cache.keys, cache.values)]
    hidden, layers, trace = self._trunk(tokens, positions, (attend, keys_at), layers, valid=mask)
    new_cache = cache.replace(keys=tuple(c.keys for c in layers), values=tuple(c.values for c in layers),
                              **bookkeeping)
    return self._outputs(self._head_at(hidden, logits_at), new_cache, trace, with_routes)

  def forward_paged(self, tokens, pool: PagePool, table, length, attention_mask=None, window: int | None = None,
                    logits_at: jax.Array | None = None, with_routes: bool = False):
    """Runs tokens [B, T] (their real ones a prefix of each row, `attention_mask`) after the `length` [B]
    tokens each row holds in its pages (`table` [B, pages_per_row] into `pool`); returns (logits, pool), and the
    routed experts as `forward_with_cache` does.

    `window` (static, a multiple of the page size): attention reads only the first `window` tokens of each
    row; every row's tokens, this chunk's included, must lie below it. `logits_at` as in `forward_with_cache`.
    A pool with a `kernel` computes a decode step's attention in it, in every layer without a sliding window.
    """
    mask = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    window = window or table.shape[1] * pool.page_size
    positions = jnp.maximum(length[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
    attend = chunk_mask(length, mask, window)
    keys_at = jnp.arange(window, dtype=jnp.int32)[None]  # a row's token i is at index i of its pages
    layers = [PagedLayer(k, v, table, length, mask, None if self.config.layer_window(i) is not None else pool.kernel)
              for i, (k, v) in enumerate(zip(pool.keys, pool.values))]
    hidden, layers, trace = self._trunk(tokens, positions, (attend, keys_at), layers, valid=mask)
    pool = pool.replace(keys=tuple(c.keys for c in layers), values=tuple(c.values for c in layers))
    return self._outputs(self._head_at(hidden, logits_at), pool, trace, with_routes)

  def _outputs(self, logits, cache, trace, with_routes: bool):
    if not with_routes:
      return logits, cache
    if trace is None:
      raise ValueError("with_routes: this model has no mixture-of-experts layers")
    return logits, cache, trace.experts

  def _head_at(self, hidden, logits_at):
    if logits_at is not None:
      hidden = jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1)
    return self.head_logits(hidden)

  def _trunk(self, tokens, positions, attention, kv_caches, remat: str | None = None, routing: Routing = Routing(),
             valid=None, layout: ActivationLayout | None = None):
    """(final hidden states, layer caches, stacked router trace). `attention` is (mask [B, T, S], the keys'
    positions [B or 1, S]): each layer masks it by its own window; or (a `SegmentMask`, positions) for the fused
    kernel, given each layer's window."""
    embed = self.embed[...]
    x = take_rows(embed, tokens)
    if self.config.embed_scale:  # in the weights' dtype, as transformers scales Gemma's embeddings
      x = x * jnp.asarray(math.sqrt(self.config.hidden_size), embed.dtype)
    x = x.astype(self.config.compute_dtype)
    rows = (lambda h: h) if layout is None else layout.rows  # noqa: E731
    if isinstance(attention[0], SegmentMask):
      masks = {w: attention[0].with_window(w) for w in {None, *self.config.windows}}
    else:
      masks = window_masks(attention[0], positions, attention[1], self.config.windows)
    run = _LAYER_RUNS[remat or self.config.remat]
    new_kv, traces = [], []
    x = rows(x)
    for i, layer in enumerate(self.layers):
      if layout is not None and layout.trained is not None:
        layer, x = fenced(layer, x, layout.trained)
      routed = routing.layer(len(traces), valid) if layer.sparse else None
      x, kv, trace = run(layer, x, positions, masks[self.config.layer_window(i)],
                         None if kv_caches is None else kv_caches[i], routed)
      x = rows(x)
      new_kv.append(kv)
      if trace is not None:
        traces.append(trace)
    return self.final_norm(x), new_kv, stack_traces(traces)

  def head_logits(self, hidden):
    """float32 logits [..., vocab] of final hidden states (accumulated in float32 also when computing in bfloat16:
    log-probabilities over a large vocabulary need the precision)."""
    weights, vocab_axis = self.output_weights()
    weights = weights.astype(hidden.dtype)
    if vocab_axis == 1:
      return jnp.matmul(hidden, weights, preferred_element_type=jnp.float32)
    # tied: the embeddings [vocab, hidden] as the left operand, as stored, and the small result transposed (XLA:CPU
    # made a transposed copy of the embeddings for hidden @ embeddings.T each call: 40 ms of a SmolLM2 decode call)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logits = jax.lax.dot_general(weights, flat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return logits.T.reshape(*hidden.shape[:-1], weights.shape[0])


class ValueModel(nnx.Module):
  """A critic for PPO: its own decoder trunk and a scalar head, values [B, T] in float32."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.trunk = Transformer(config, rngs=rngs)
    self.value_head = nnx.Param(jnp.zeros((config.hidden_size,), config.weight_dtype), logical_axes=("embed",))

  def __call__(self, tokens, attention_mask=None, segment_ids=None) -> jax.Array:
    hidden = self.trunk.hidden_states(tokens, attention_mask, segment_ids)
    return (hidden @ self.value_head[...].astype(hidden.dtype)).astype(jnp.float32)


def abstract_model(model_config: ModelConfig):
  """(graphdef, parameter structure without values) of a model config."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
