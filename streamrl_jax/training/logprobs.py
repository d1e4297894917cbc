"""Log-probabilities and entropies of the tokens a sequence holds, with or without the full logits.

`token_logprobs(logits, tokens)` reads materialized logits [B, T, vocab]. `chunked_token_logprobs(hidden, head,
tokens, vocab_axis=...)` never builds them: it walks the vocabulary in chunks of the output weights as they are
stored (the tied embeddings [vocab, hidden], or an LM head [hidden, vocab]), keeping per token an online
log-sum-exp (running max, sum of exponentials, and their logit-weighted sum for the entropy) and the chosen
token's logit. Its custom VJP recomputes each chunk's logits in the backward pass, so memory holds one
[tokens, chunk] block at a time instead of [tokens, vocab] several times over (logits, log-softmax, their
gradients). Both give log pi(tokens[:, t] | tokens[:, :t]) aligned with tokens (column 0 is 0) and the entropy of
the distribution that predicted each token.

Gradients, per token with p = softmax(l), E = sum_j p_j l_j:  d logp / d l_j = [j = token] - p_j;
d entropy / d l_j = -p_j (l_j - E).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.models.layers import cpu_low_precision, rows_first
from streamrl_jax.models.sharding import batch_axes, logical_spec
from streamrl_jax.truncation import truncation_floor

FLOOR_BLOCK = 128  # tokens whose full logits a support rebuild holds at once


@dataclasses.dataclass(frozen=True)
class Truncation:
  """The sampler's top-k, top-p and min-p (`SamplerConfig`): the trainer scores each token over the support they keep,
  from its own logits by the sampler's function (`truncation.truncation_floor`), renormalised."""

  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  @property
  def active(self) -> bool:
    return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0


def support_floors(logits_of, hidden, tokens, temperature: float, truncation: Truncation, block: int = FLOOR_BLOCK):
  """Per token of hidden [N, H] and tokens [N]: (the floor of the support the sampler's filters keep of the tempered
  logits `logits_of(hidden) / temperature`, lowered to the token's own logit where that lies below it; whether it
  did: a token the sampler drew that the trainer's support leaves out). No gradient; `block` tokens' full logits at a
  time."""
  n, width = hidden.shape
  rows = -(-n // block) * block
  blocks = (jnp.pad(jax.lax.stop_gradient(hidden), ((0, rows - n), (0, 0))).reshape(-1, block, width),
            jnp.pad(tokens, (0, rows - n)).reshape(-1, block))

  def one(args):
    h, t = args
    return floors_of(logits_of(h).astype(jnp.float32) / temperature, t, truncation)
  floors, outside = jax.lax.map(one, blocks)
  return floors.reshape(-1)[:n], outside.reshape(-1)[:n]


def floors_of(scaled, tokens, truncation: Truncation):
  """`support_floors` of tempered logits scaled [N, vocab] and tokens [N]. The floor is the logit of the support's
  last entry; logits computed by another product (the sampler's, a chunk's) may round that entry a few ulps below
  it, so the floor returned lies midway between it and the largest logit below it: rounding smaller than half
  that gap moves no entry across."""
  rows = scaled.shape[0]
  floor = truncation_floor(scaled, jnp.full((rows,), truncation.top_k, jnp.int32),
                           jnp.full((rows,), truncation.top_p, jnp.float32), jnp.full((rows,), truncation.min_p))
  below = jnp.max(jnp.where(scaled < floor[:, None], scaled, -jnp.inf), axis=-1)
  floor = jnp.where(below > -jnp.inf, 0.5 * (floor + below), floor)
  picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
  return jnp.minimum(floor, picked), picked < floor


def entropy(logits):
  """Entropy of the softmax distribution over the last axis."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(logits, tokens):
  """From logits [B, T, vocab]: (log pi of each token [B, T], entropy [B, T]); column 0 is 0."""
  logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  pad = jnp.zeros_like(picked[:, :1])
  return jnp.concatenate([pad, picked], axis=1), jnp.concatenate([pad, entropy(logits[:, :-1])], axis=1)


def vocab_chunk(vocab: int, wanted: int) -> int:
  """The chunk width used for `wanted` columns: the largest divisor of `vocab` not above it (no padded copy
  of the head), or `wanted` itself when every such divisor is under a quarter of it (the head is then padded)."""
  if wanted <= 0 or wanted >= vocab:
    return vocab
  best = max(d for d in range(1, wanted + 1) if vocab % d == 0)
  return best if best * 4 >= wanted else wanted


def chunked_token_logprobs(hidden, head, tokens, temperature: float = 1.0, chunk: int = 8192, vocab_axis: int = 1,
                           head_grad: bool = True):
  """From final hidden states [B, T, H] and the output weights `head` ([H, vocab] with `vocab_axis=1`, or the tied
  embeddings [vocab, H] with `vocab_axis=0`): (log pi [B, T], entropy [B, T]) as `token_logprobs` gives them from
  the logits, without the [B, T, vocab] logits. The weights are read, and their gradient written, a chunk of the
  vocabulary at a time in their own layout: no transposed copy of a [vocab, H] matrix. `head_grad=False` (a frozen
  head: LoRA's base) skips the weights' gradient, a third of the head's backward work (their gradient is zero)."""
  return every_column(chunked_scorer(head, temperature, chunk, vocab_axis, head_grad), hidden, tokens)[:2]


def logits_scorer(logits_of, temperature: float = 1.0, truncation: Truncation = Truncation()):
  """`score(hidden [N, H], tokens [N]) -> (log pi [N], entropy [N], outside [N])` from the full logits
  `logits_of(hidden)` [N, vocab], divided by `temperature` (`token_logprobs`'s arithmetic), over the support
  `truncation` keeps (`outside`: the token lay below it)."""

  def score(hidden, tokens):
    tokens = tokens.astype(jnp.int32)
    logits = logits_of(hidden).astype(jnp.float32)
    scaled = logits / temperature if temperature != 1.0 else logits
    outside = jnp.zeros(tokens.shape, bool)
    if truncation.active:
      floors, outside = floors_of(jax.lax.stop_gradient(scaled), tokens, truncation)
      scaled = jnp.where(scaled >= floors[:, None], scaled, -jnp.inf)
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    picked = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    if truncation.active:  # 0 outside the support (its -inf would make 0 * -inf, in value and gradient)
      inside = logp_all > -jnp.inf
      safe = jnp.where(inside, logp_all, 0.0)
      plogp = jnp.where(inside, jnp.exp(safe) * safe, 0.0)
    else:
      plogp = jnp.exp(logp_all) * logp_all
    return picked, -jnp.sum(plogp, axis=-1), outside
  return score


def chunked_scorer(head, temperature: float = 1.0, chunk: int = 8192, vocab_axis: int = 1, head_grad: bool = True,
                   truncation: Truncation = Truncation(), mesh: Mesh | None = None):
  """`score(hidden [N, H], tokens [N]) -> (log pi [N], entropy [N], outside [N])` over vocabulary chunks of `head`, as
  `chunked_token_logprobs` computes them, over the support `truncation` keeps (`support_floors`). On a trainer's
  `mesh`, the tokens stay split over its batch axes, each chunk of the head is gathered whole (FSDP), and the head's
  gradient is reduced into its own sharding chunk by chunk: left to itself, GSPMD gathered every token's logits (or
  their gradient) onto every device instead, a [tokens, chunk] array a chunk."""
  width = vocab_chunk(head.shape[vocab_axis], chunk)

  def score(hidden, tokens):
    tokens = tokens.astype(jnp.int32)
    if not truncation.active:
      floors, outside = jnp.full(tokens.shape, -jnp.inf), jnp.zeros(tokens.shape, bool)
    else:
      logits_of = lambda h: jax.lax.dot_general(h, head.astype(h.dtype), (((1,), (1 - vocab_axis,)), ((), ())),  # noqa
                                                preferred_element_type=jnp.float32)
      floors, outside = support_floors(logits_of, hidden, tokens, float(temperature), truncation)
    logp, ent = _chunked(hidden, head, tokens, floors, _Plan(float(temperature), width, vocab_axis, bool(head_grad),
                                                             truncation.active, mesh))
    return logp, ent, outside
  return score


def every_column(score, hidden, tokens):
  """(log pi, entropy, outside) [B, T] of every token after the first (column 0: 0) by `score` (`chunked_scorer`)."""
  b, t, h = hidden.shape
  values = score(hidden[:, :-1].reshape(b * (t - 1), h), tokens[:, 1:].reshape(-1))
  return tuple(jnp.concatenate([jnp.zeros((b, 1), v.dtype), v.reshape(b, t - 1)], axis=1) for v in values)


def at_columns(score, hidden, tokens, columns):
  """`every_column`'s (log pi, entropy, outside) [B, T] at `columns` [B, K] only (each row's scored tokens, 1..T-1;
  T marks an unused entry) and 0 elsewhere: the head's work for K of a row's T - 1 positions (`scored_columns`)."""
  b, t, h = hidden.shape
  k = columns.shape[1]
  before = jnp.take_along_axis(hidden, jnp.clip(columns - 1, 0, t - 1)[..., None], axis=1)
  scored = jnp.take_along_axis(tokens, jnp.minimum(columns, t - 1), axis=1)
  values = score(before.reshape(b * k, h), scored.reshape(-1))
  rows = jnp.arange(b)[:, None]
  return tuple(jnp.zeros((b, t), v.dtype).at[rows, columns].set(v.reshape(b, k), mode="drop") for v in values)


def scored_columns(loss_mask) -> np.ndarray | None:
  """Host side: per row, the columns of `loss_mask` [rows, T] (the tokens a loss scores), padded with T, in a
  [rows, K] array of K = half the row rounded up to 8; None where a row holds more (every column is then scored).
  Prompt tokens, most of an RL row on short answers, then skip the head: 2 x vocab x hidden FLOPs each forward."""
  mask = np.asarray(loss_mask, bool)
  width = mask.shape[1]
  k = -(-width // 16) * 8
  if k >= width - 1 or int(mask.sum(axis=1).max(initial=0)) > k:
    return None
  order = np.argsort(~mask, axis=1, kind="stable")[:, :k]
  return np.where(np.take_along_axis(mask, order, axis=1), order, width).astype(np.int32)


def _padded(head, chunk: int, axis: int):
  """The weights with their vocabulary padded to a whole number of chunks (a copy only when it does not divide)."""
  vocab = head.shape[axis]
  extra = -vocab % chunk
  pad = [(0, 0), (0, 0)]
  pad[axis] = (0, extra)
  return (head if not extra else jnp.pad(head, pad)), (vocab + extra) // chunk


def _block(padded, i, chunk: int, axis: int, dtype):
  return jax.lax.dynamic_slice_in_dim(padded, i * chunk, chunk, axis=axis).astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static half of a chunked scoring: the temperature, the chunk width, the head's vocabulary axis, whether the
  head's gradient is computed, and whether `floors` truncate the support."""

  temperature: float
  chunk: int
  axis: int
  head_grad: bool
  truncated: bool
  mesh: Mesh | None = None  # the trainer's: the shardings the chunks keep (`chunked_scorer`)

  def placed(self, x, spec: PartitionSpec):
    return x if self.mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def rows(self, x):
    """`x` [N, ...] split over the mesh's batch axes (where they divide N)."""
    if self.mesh is None:
      return x
    axes = batch_axes(self.mesh, x.shape[0])
    return self.placed(x, PartitionSpec(axes) if axes else PartitionSpec())

  def head_sharded(self, x):
    """A [vocab, H] or [H, vocab] gradient in the head's own sharding (the logical rules': its hidden axis over
    "fsdp" where it divides)."""
    if self.mesh is None:
      return x
    names = ("vocab", "embed") if self.axis == 0 else ("embed", "vocab")
    return self.placed(x, logical_spec(names, x.shape, self.mesh))


def _chunk_logits(hidden, padded, i, plan: _Plan, vocab: int, floors, tokens):
  """Tempered float32 logits of vocabulary entries [i * chunk, (i + 1) * chunk), padding entries at -inf, and with a
  truncated plan those below their token's floor [N] but the token itself (its floor came from logits computed apart,
  which may round it below)."""
  chunk, axis, temperature = plan.chunk, plan.axis, plan.temperature
  block = plan.placed(_block(padded, i, chunk, axis, hidden.dtype), PartitionSpec())  # the chunk gathered whole
  logits = jax.lax.dot_general(hidden, block, (((1,), (1 - axis,)), ((), ())), preferred_element_type=jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  if vocab % chunk:
    logits = jnp.where(i * chunk + jnp.arange(chunk) < vocab, logits, -jnp.inf)
  if plan.truncated:
    own = (tokens[:, None] - i * chunk) == jnp.arange(chunk)[None, :]
    logits = jnp.where((logits >= floors[:, None]) | own, logits, -jnp.inf)
  return logits


def _statistics(hidden, head, tokens, floors, plan: _Plan):
  """Per token: log-sum-exp, the chosen logit, and E_p[logit], by one pass over the vocabulary chunks."""
  chunk = plan.chunk
  vocab = head.shape[plan.axis]
  padded, chunks = _padded(head, chunk, plan.axis)
  n = hidden.shape[0]
  hidden = plan.rows(hidden)

  def body(i, carry):
    top, total, weighted, picked = carry
    logits = _chunk_logits(hidden, padded, i, plan, vocab, floors, tokens)
    new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
    safe = jnp.where(new_top > -jnp.inf, new_top, 0.0)  # a truncated support may leave a whole chunk at -inf
    scale = jnp.exp(top - safe)
    e = jnp.exp(logits - safe[:, None])
    total = total * scale + jnp.sum(e, axis=-1)
    weighted = weighted * scale + jnp.sum(jnp.where(e > 0, e * logits, 0.0), axis=-1)
    local = tokens - i * chunk
    inside = (local >= 0) & (local < chunk)
    chosen = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[:, None], axis=-1)[:, 0]
    return new_top, total, weighted, jnp.where(inside, chosen, picked)

  zeros = jnp.zeros((n,), jnp.float32)
  top, total, weighted, picked = jax.lax.fori_loop(0, chunks, body, (jnp.full((n,), -jnp.inf), zeros, zeros, zeros))
  return top + jnp.log(total), picked, weighted / total


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked(hidden, head, tokens, floors, plan: _Plan):
  lse, picked, mean = _statistics(hidden, head, tokens, floors, plan)
  return picked - lse, lse - mean


def _chunked_fwd(hidden, head, tokens, floors, plan: _Plan):
  lse, picked, mean = _statistics(hidden, head, tokens, floors, plan)
  return (picked - lse, lse - mean), (hidden, head, tokens, floors, lse, mean)


def _chunked_bwd(plan: _Plan, residuals, cotangents):
  hidden, head, tokens, floors, lse, mean = residuals
  g_logp, g_ent = cotangents
  chunk, axis, temperature, head_grad = plan.chunk, plan.axis, plan.temperature, plan.head_grad
  vocab = head.shape[axis]
  padded, chunks = _padded(head, chunk, axis)
  hidden = plan.rows(hidden)

  def body(i, carry):
    g_hidden, g_head = carry
    logits = _chunk_logits(hidden, padded, i, plan, vocab, floors, tokens)
    p = jnp.exp(logits - lse[:, None])
    onehot = (tokens[:, None] - i * chunk) == jnp.arange(chunk)[None, :]
    centred = jnp.where(p > 0, logits - mean[:, None], 0.0)
    g_logits = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * centred
    if temperature != 1.0:
      g_logits = g_logits / temperature
    g_logits = g_logits.astype(hidden.dtype)
    block = _block(padded, i, chunk, axis, hidden.dtype)
    g_hidden = g_hidden + jax.lax.dot_general(g_logits, block, (((1,), (axis,)), ((), ())),
                                              preferred_element_type=jnp.float32)
    if not head_grad:
      return g_hidden, g_head
    pair = (g_logits, hidden) if axis == 0 else (hidden, g_logits)  # the block's own layout: [chunk, H] or [H, chunk]
    g_block = _tokens_contracted(*pair)
    return g_hidden, plan.head_sharded(jax.lax.dynamic_update_slice_in_dim(g_head, g_block, i * chunk, axis=axis))

  init = (plan.rows(jnp.zeros(hidden.shape, jnp.float32)),
          plan.head_sharded(jnp.zeros(padded.shape, jnp.float32)) if head_grad else jnp.zeros((), jnp.float32))
  g_hidden, g_head = jax.lax.fori_loop(0, chunks, body, init)
  g_head = jax.lax.slice_in_dim(g_head, 0, vocab, axis=axis) if head_grad else jnp.zeros(head.shape, head.dtype)
  return g_hidden.astype(hidden.dtype), g_head.astype(head.dtype), None, jnp.zeros_like(floors)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _tokens_contracted(a, b):
  """a [tokens, m]^T @ b [tokens, n] in float32; in low precision on a CPU with `a` copied rows first
  (`layers.rows_first`: XLA:CPU's fast bfloat16 matmul takes row-major operands only)."""
  if cpu_low_precision(a.dtype):
    return jax.lax.dot_general(rows_first(a), b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
