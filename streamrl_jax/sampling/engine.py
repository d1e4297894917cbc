"""The decode engine: JetStream's engine shape (prefill / insert / generate) over a pytree decode state.

Slots are sharded over the mesh's "data" axis and parameters by the model's logical rules. Every
jitted function is built once here (the one jit boundary of an engine). Up to `prefill_batch` requests are
prefilled (and inserted) per call, their count padded to a power of two and their length to a power-of-two
bucket; requests of one prompt (a GRPO group's) share one pass of the model over it (`share_prompts`), then each
takes a copy of its keys and values and samples its own first token (`_expand`). With R = len(row_buckets) and
L = len(prefill_buckets), an engine compiles at most `L * (2 * R + R * (R + 1) / 2) + W * len(step_options)`
programs, W = len(attention_windows) (the model over the distinct prompts and the insert: R x L each; the
expansion: one per pair of distinct and requested row buckets, per length; a decode call per window and length),
and as many again over `resume_buckets` once requests resume after their prompt's length (partial rollouts, caches
recomputed for new weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.models import KVCache, ModelConfig, kv_cache_bytes, logical_spec
from streamrl_jax.sampling.config import KV_LAYOUTS, EngineConfig
from streamrl_jax.sampling.engine_base import (Engine, EngineBase, PlannedCall, StepOutput, device_memory_budget,
                                               first_tokens, sample_next, shapes_of)
from streamrl_jax.types import SamplingParams

__all__ = ["KV_LAYOUTS", "DecodeEngine", "DecodeState", "Engine", "EngineConfig", "Prefix", "StepOutput"]


@flax.struct.dataclass
class DecodeState:
  """Everything the engine keeps per slot, as one pytree."""

  cache: KVCache
  last_token: jax.Array  # [S] int32: token to feed at the next step
  rng: jax.Array  # [S, 2] uint32: the request's key data
  generated: jax.Array  # [S] int32: completion tokens so far
  active: jax.Array  # [S] bool
  temperature: jax.Array  # [S] float32
  top_k: jax.Array  # [S] int32
  top_p: jax.Array  # [S] float32
  min_p: jax.Array  # [S] float32
  max_new: jax.Array  # [S] int32
  stop_ids: jax.Array  # [S, max_stop_tokens] int32, -1 padded


@flax.struct.dataclass
class Prefix:
  """`prefill_batch` prefilled prompts (rows past the real ones are padding) and their first sampled
  tokens, ready to insert into slots."""

  keys: tuple[jax.Array, ...]  # per layer [rows, kv_heads, bucket, head_dim]
  values: tuple[jax.Array, ...]
  valid: jax.Array  # [rows, bucket]
  true_length: jax.Array  # [rows] int32
  first_token: jax.Array  # [rows]
  first_logprob: jax.Array
  done: jax.Array  # [rows] bool: the first token already ends the request
  generated: jax.Array  # [rows] int32: completion tokens once the first is in (1; a resumed request's count)
  rng: jax.Array  # [rows, 2]
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  max_new: jax.Array
  stop_ids: jax.Array  # [rows, max_stop_tokens]
  routes: jax.Array | None = None  # a mixture: [rows, bucket, sparse layers, k] experts each prompt token took


def shared_prompts(prompts: Sequence, resume: Sequence) -> tuple[list[int], np.ndarray]:
  """(the first request of each distinct fresh prompt, and resumed request, in order; for each request the
  position of its own in that list): a group's requests share one prefill of their prompt."""
  firsts, seen, source = [], {}, np.zeros((len(prompts),), np.int32)
  for i, (prompt, resumed) in enumerate(zip(prompts, resume)):
    key = None if resumed else tuple(int(t) for t in prompt)
    if key is None or key not in seen:
      if key is not None:
        seen[key] = len(firsts)
      source[i] = len(firsts)
      firsts.append(i)
    else:
      source[i] = seen[key]
  return firsts, source


class DecodeEngine(EngineBase):
  """An `Engine` for a `Transformer` on one mesh whose slots each hold a whole cache (the contiguous layout).
  Params are the model's `nnx.State`."""

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    super().__init__(graphdef, model_config, config, mesh, rules)
    self.memory = self._check_memory()
    self._state_shardings = self._decode_state_shardings()
    replicated = NamedSharding(mesh, PartitionSpec())
    jit = self.launcher.jit
    self._prefill = jit(self._prefill_impl, out_shardings=replicated)  # the model over each distinct prompt
    self._expand = jit(self._expand_impl, out_shardings=replicated)  # a row per request, its first token sampled
    self._insert = jit(self._insert_impl, donate_argnums=(1,), out_shardings=self._state_shardings)
    self._generate = jit(self._generate_impl, static_argnums=(2, 3), donate_argnums=(1,),
                         out_shardings=(self._state_shardings, replicated))
    self._extend = jit(self._extend_impl, donate_argnums=(1,), out_shardings=(self._state_shardings, replicated))
    self._move = jit(self._move_impl, static_argnums=(4,), donate_argnums=(1,), out_shardings=self._state_shardings)
    self._init_state = jit(self._empty_state, out_shardings=self._state_shardings)  # once: a new jit traces anew

  # ---- placement and memory -------------------------------------------------------------------
  def _decode_state_shardings(self):
    abstract = jax.eval_shape(self._empty_state)

    def spec(x):
      names = ("batch", "kv_heads", None, "head_dim") if x.ndim == 4 else ("batch",) + (None,) * (x.ndim - 1)
      return NamedSharding(self.mesh, logical_spec(names, x.shape, self.mesh, self.rules))
    return jax.tree.map(spec, abstract)

  def _check_memory(self) -> dict:
    mc, ec = self.model_config, self.config
    tensor = self.mesh.shape.get("tensor", 1)
    data = self.mesh.devices.size // tensor
    param_bytes = self.param_bytes()
    per_slot = kv_cache_bytes(mc, 1, ec.cache_length)
    per_device = param_bytes / tensor + per_slot * math.ceil(ec.num_slots / data) / tensor
    budget = ec.memory_budget_bytes or device_memory_budget(self.mesh.devices.flat[0])
    report = dict(param_bytes=param_bytes, kv_bytes_per_slot=per_slot, kv_bytes=per_slot * ec.num_slots,
                  bytes_per_device=int(per_device), budget_bytes_per_device=int(budget))
    if per_device > budget:
      raise ValueError(
          f"engine needs {per_device / 2**20:.1f} MiB per device ({param_bytes / 2**20:.1f} MiB of parameters "
          f"/ tensor={tensor}, {ec.num_slots} slots x {per_slot / 2**20:.2f} MiB of KV cache / data={data}) but the "
          f"budget is {budget / 2**20:.1f} MiB; lower num_slots, max_prompt_length or max_new_tokens")
    return report

  # ---- memory as rows grow: every slot holds its whole cache already -----------------------------
  def admissible(self, decode_state, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int:
    """How many of `prompts` (in order) have the memory to start: all, a free slot is enough here."""
    return len(prompts)

  def make_room(self, decode_state, progress: dict[int, int]) -> tuple[DecodeState, list[int]]:
    """Memory for the busy slots' next `steps_per_sync` tokens: always there; nothing is preempted."""
    return decode_state, []

  def extend_room(self, decode_state, rows: dict[int, int]) -> tuple[DecodeState, list[int]]:
    """Memory for paused rows' appended tokens (`rows[slot]` of them): a slot holds its whole cache; none refused."""
    return decode_state, []

  def release(self, decode_state, slot: int) -> DecodeState:
    """A finished slot's memory goes back: nothing to do, insert overwrites it."""
    return decode_state

  # ---- the Engine API ---------------------------------------------------------------------------
  def _empty_state(self) -> DecodeState:
    s, ec = self.config.num_slots, self.config
    return DecodeState(
        cache=KVCache.init(self.model_config, s, ec.cache_length), last_token=jnp.zeros((s,), jnp.int32),
        rng=jnp.zeros((s, 2), jnp.uint32), generated=jnp.zeros((s,), jnp.int32), active=jnp.zeros((s,), bool),
        temperature=jnp.ones((s,), jnp.float32), top_k=jnp.zeros((s,), jnp.int32),
        top_p=jnp.ones((s,), jnp.float32), min_p=jnp.zeros((s,), jnp.float32), max_new=jnp.ones((s,), jnp.int32),
        stop_ids=jnp.full((s, ec.max_stop_tokens), -1, jnp.int32))

  def init_decode_state(self) -> DecodeState:
    return self._init_state()

  def planned_calls(self, params) -> tuple[dict[str, PlannedCall], DecodeState]:
    """(the model over a call of `prefill_batch` distinct prompts of the longest bucket (`prefill`, beside the decode
    state) and `decode` (one step of every slot over the whole cache) lowered for a plan, the decode state's shapes);
    `params` are shapes placed by `place_params`."""
    ec = self.config
    state = shapes_of(self._empty_state, self._state_shardings)
    tokens = np.zeros((ec.prefill_batch, ec.bucket_for(ec.max_prompt_length)), np.int32)
    lengths = np.full((ec.prefill_batch,), ec.max_prompt_length, np.int32)
    return {"prefill": PlannedCall(self._prefill.trace(params, tokens, lengths).lower(), reads_state=False),
            "decode": PlannedCall(self._generate.trace(params, state, ec.cache_length, 1).lower(), True)}, state

  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None, version: int = 0) -> Prefix:
    """Runs up to `prefill_batch` prompts (unpadded int tokens) in one call and samples each one's first
    token with its key data `rngs[i]` [2]; rows are padded to the longest prompt's bucket, and their count
    to a row bucket (padding rows are computed and dropped). `resume[i] = (last token, tokens generated)`
    continues a request whose `prompts[i]` is its prompt + tokens so far but the last (preempted, handed
    over, or recomputed with new weights): that token is its next input, not sampled. `version` (of the
    weights) keys a prefix cache; this engine keeps none."""
    resume = list(resume) if resume is not None else [None] * len(prompts)
    if len(prompts) != len(samplings):
      raise ValueError(f"prefill takes one SamplingParams per prompt; got {len(prompts)} and {len(samplings)}")
    arrays = self.request_arrays(samplings, rngs, resume)
    rows = arrays.rng.shape[0]
    bucket = max(self.config.resume_bucket_for(len(p)) if r else self.config.bucket_for(len(p))
                 for p, r in zip(prompts, resume))
    firsts, source = shared_prompts(prompts, resume) if self.config.share_prompts else (range(len(prompts)), None)
    distinct = self.config.row_bucket_for(len(firsts))
    tokens, lengths = np.zeros((distinct, bucket), np.int32), np.ones((distinct,), np.int32)
    for j, i in enumerate(firsts):
      tokens[j, :len(prompts[i])], lengths[j] = prompts[i], len(prompts[i])
    index = np.zeros((rows,), np.int32)  # padding requests read row 0 (they are dropped at insert)
    index[:len(prompts)] = np.arange(len(prompts)) if source is None else source
    return self._expand(self._prefill(params, tokens, lengths), index, arrays)

  def _prefill_impl(self, params, tokens, true_length):
    """(last logits [rows, vocab], the cache of each prompt) for `rows` distinct prompts."""
    model = nnx.merge(self.graphdef, params)
    rows, bucket = tokens.shape
    mask = jnp.arange(bucket)[None, :] < true_length[:, None]
    cache = KVCache.init(self.model_config, rows, bucket)
    logits, cache, *routes = model.forward_with_cache(tokens, cache, mask, logits_at=true_length - 1,
                                                      with_routes=self.routed)
    return logits[:, 0], cache.replace(index=true_length), (routes or [None])[0]

  def _expand_impl(self, prefilled, index, arrays):
    """The Prefix of every request: request i takes its prompt's row `index[i]`, and samples its own first token."""
    last_logits, cache, routes = prefilled
    take = lambda x: x[index]  # noqa: E731
    token, logprob, done = first_tokens(take(last_logits), *arrays.knobs)
    resumed = arrays.given >= 0
    return Prefix(keys=tuple(map(take, cache.keys)), values=tuple(map(take, cache.values)), valid=take(cache.valid),
                  true_length=take(cache.index), first_token=jnp.where(resumed, arrays.given, token),
                  first_logprob=jnp.where(resumed, 0.0, logprob), done=done & ~resumed, generated=arrays.generated,
                  rng=arrays.rng, temperature=arrays.temperature, top_k=arrays.top_k, top_p=arrays.top_p,
                  min_p=arrays.min_p, max_new=arrays.max_new, stop_ids=arrays.stop_ids,
                  routes=None if routes is None else take(routes))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
    """Puts row i of `prefix` into slot `slots[i]`; the prefix's remaining (padding) rows are dropped."""
    rows, num_slots = prefix.valid.shape[0], self.config.num_slots
    if len(slots) > rows or len(set(slots)) != len(slots) or any(not 0 <= s < num_slots for s in slots):
      raise ValueError(f"insert takes up to {rows} distinct slots in 0..{num_slots - 1}, got {list(slots)}")
    targets = np.full((rows,), num_slots, np.int32)  # out of range: dropped
    targets[:len(slots)] = slots
    return self._insert(prefix, decode_state, targets)

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slots):
    cache = state.cache
    bucket = prefix.valid.shape[1]
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    put_kv = lambda big, small: big.at[slots, :, :bucket].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    row_valid = jnp.zeros((slots.shape[0], cache.max_len), bool).at[:, :bucket].set(prefix.valid)
    # a prefix's token i sits at index i and rotary position i (prompts are prefilled from the row's start)
    row_positions = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), row_valid.shape)
    cache = cache.replace(
        keys=tuple(put_kv(k, pk) for k, pk in zip(cache.keys, prefix.keys)),
        values=tuple(put_kv(v, pv) for v, pv in zip(cache.values, prefix.values)),
        valid=put(cache.valid, row_valid), positions=put(cache.positions, row_positions),
        index=put(cache.index, prefix.true_length),
        next_position=put(cache.next_position, prefix.true_length))
    return state.replace(
        cache=cache, last_token=put(state.last_token, prefix.first_token), rng=put(state.rng, prefix.rng),
        generated=put(state.generated, prefix.generated), active=put(state.active, ~prefix.done),
        temperature=put(state.temperature, prefix.temperature), top_k=put(state.top_k, prefix.top_k),
        top_p=put(state.top_p, prefix.top_p), min_p=put(state.min_p, prefix.min_p),
        max_new=put(state.max_new, prefix.max_new),
        stop_ids=put(state.stop_ids, prefix.stop_ids))

  def generate(self, params, decode_state: DecodeState, window: int | None = None,
               steps: int | None = None) -> tuple[DecodeState, StepOutput]:
    """`steps` decode steps (one of `config.step_options`; default `steps_per_sync`) for every slot (inactive
    slots compute but change nothing).

    `window`, one of `config.attention_windows`, must exceed every active slot's last write
    (its cache index + steps - 1); the default, the whole cache, always does.
    """
    return self._generate(params, decode_state, self._window(window), self._steps(steps))

  def _generate_impl(self, params, state: DecodeState, window: int, steps: int):
    model = nnx.merge(self.graphdef, params)

    def step(state: DecodeState, _):
      active = state.active
      logits, cache, *routes = model.forward_with_cache(state.last_token[:, None], state.cache, active[:, None],
                                                        window, with_routes=self.routed)
      cache = cache.replace(index=jnp.where(active, cache.index, state.cache.index))
      changes, out = sample_next(state, logits)
      return state.replace(cache=cache, **changes), out.replace(routes=routes[0][:, 0] if routes else None)

    return jax.lax.scan(step, state, None, length=steps)

  # ---- multi-turn rows: extend a paused row, park it off its slot and back --------------------------
  def _extend_call(self, params, decode_state, targets, chunk, lengths):
    return self._extend(params, decode_state, targets, chunk, lengths)

  def _extend_impl(self, params, state, targets, chunk, lengths):
    model = nnx.merge(self.graphdef, params)
    rows = jax.tree.map(lambda a: a[jnp.minimum(targets, self.config.num_slots - 1)], state)
    mask = jnp.arange(chunk.shape[1])[None, :] < lengths[:, None]
    logits, cache, *routes = model.forward_with_cache(chunk, rows.cache, mask, logits_at=jnp.maximum(lengths - 1, 0),
                                                      with_routes=self.routed)
    cache = cache.replace(index=rows.cache.index + lengths)  # padding past a row's tokens is overwritten later
    # The first appended token (the stop token) was counted when it was sampled; the tool's tokens count now.
    rows = rows.replace(cache=cache, active=lengths > 0, generated=rows.generated + jnp.maximum(lengths - 1, 0))
    changes, out = sample_next(rows, logits)
    rows = rows.replace(**changes)
    state = jax.tree.map(lambda big, small: big.at[targets].set(small, mode="drop"), state, rows)
    return state, (out.tokens, out.logprobs, out.done, *routes)

  def init_parking(self) -> DecodeState:
    """Room for `num_slots` rows parked off their slots (rows waiting on a tool): a decode state's shape."""
    return self.init_decode_state()

  def park(self, decode_state, parking, slots: Sequence[int], places: Sequence[int]):
    """Moves the paused rows of `slots` into `parking` at `places` (their whole cache, token count and knobs),
    so the slots may take other requests; `unpark` brings them back into any free slots. Returns (state,
    parking); compiles once per row bucket."""
    for a, b in self.row_calls(slots, places):
      parking = self._move(decode_state, parking, a, b, False)
    return decode_state, parking

  def unpark(self, decode_state, parking, places: Sequence[int], slots: Sequence[int]):
    """Puts parked rows back from `places` into `slots`, inactive until `extend` goes on from them; returns
    (state, parking)."""
    for a, b in self.row_calls(places, slots):
      decode_state = self._move(parking, decode_state, a, b, True)
    return decode_state, parking

  def drop_parked(self, decode_state, parking, place: int):
    """A parked row whose episode ended: its place is simply taken by the next one; returns (state, parking)."""
    return decode_state, parking

  def _move_impl(self, source, target, rows_from, rows_to, inactive: bool):
    rows = jax.tree.map(lambda a: a[rows_from], source)
    if inactive:
      rows = rows.replace(active=jnp.zeros_like(rows.active))
    return jax.tree.map(lambda big, small: big.at[rows_to].set(small, mode="drop"), target, rows)
