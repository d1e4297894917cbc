"""The decode engine: JetStream's engine shape (prefill / insert / generate) over a pytree decode state.

Slots are sharded over the mesh's "data" axis and parameters by the model's logical rules. Every
jitted function is built once here (the one jit boundary of an engine). Up to `prefill_batch` prompts are
prefilled (and inserted) per call, their count padded to a power of two and their length to a power-of-two
bucket, so an engine compiles at most `2 * len(prefill_buckets) * len(row_buckets) + len(attention_windows)`
programs, and `2 * len(resume_buckets) * len(row_buckets)` more once requests resume after their prompt's length
(partial rollouts, caches recomputed for new weights).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import launch
from streamrl_jax.models import KVCache, ModelConfig, kv_cache_bytes, logical_spec, state_shardings
from streamrl_jax.sampling.row_moves import RowMoves
from streamrl_jax.sampling.sample import sample_tokens
from streamrl_jax.types import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Slots and lengths of one engine instance."""

  num_slots: int = 8
  max_prompt_length: int = 64
  max_new_tokens: int = 64
  min_prefill_bucket: int = 16
  prefill_batch: int = 8  # most prompts prefilled (and inserted) per call; a power of two
  steps_per_sync: int = 1  # decode steps per host round trip
  max_stop_tokens: int = 4
  memory_budget_bytes: int = 0  # per device; 0: the device's own limit (host RAM share on CPU)
  # Cache prefixes shorter than the whole cache that a decode step may attend over when every slot
  # fits (one more compiled `generate` each). On accelerators powers of two pay off; on CPU, XLA
  # copies mid-size slices of the cache, which costs more than it saves, hence one short window.
  short_attention_windows: tuple[int, ...] = (64,)
  # "contiguous": a KV cache of cache_length per slot; "paged": a pool of pages that rows take as they grow,
  # a GRPO group's prompt prefilled once and its full pages shared (`paged_engine`).
  kv_layout: str = "contiguous"
  page_size: int = 16  # tokens per page (paged); divides every attention window
  kv_pages: int = 0  # pages in the pool (paged); 0: as many as num_slots contiguous rows would hold
  share_prompts: bool = True  # paged: requests of one prompt share its prefill and full pages
  prefix_cache_rows: int = 8  # paged: prompts whose pages and last logits stay cached for later calls

  def __post_init__(self):
    if self.kv_layout not in KV_LAYOUTS:
      raise ValueError(f"EngineConfig.kv_layout={self.kv_layout!r}; known: {list(KV_LAYOUTS)}")
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, (bool, str)):
        continue
      if field.name == "short_attention_windows":
        if any(w < 1 for w in value):
          raise ValueError(f"EngineConfig.short_attention_windows={value} must be positive")
      elif value < (0 if field.name in ("memory_budget_bytes", "kv_pages", "prefix_cache_rows") else 1):
        raise ValueError(f"EngineConfig.{field.name}={value} is out of range")
    if self.prefill_batch & (self.prefill_batch - 1):
      raise ValueError(f"EngineConfig.prefill_batch={self.prefill_batch} must be a power of two")
    if self.kv_layout == "paged":
      bad = [w for w in self.attention_windows if w % self.page_size]
      if bad:
        raise ValueError(f"EngineConfig.page_size={self.page_size} does not divide the attention windows {bad} "
                         f"(max_prompt_length + max_new_tokens and short_attention_windows)")

  @property
  def cache_length(self) -> int:
    return self.max_prompt_length + self.max_new_tokens

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    buckets, size = [], self.min_prefill_bucket
    while size < self.max_prompt_length:
      buckets.append(size)
      size *= 2
    return tuple(buckets) + (self.max_prompt_length,)

  @property
  def row_buckets(self) -> tuple[int, ...]:
    """Prompts per prefill call: the powers of two up to `prefill_batch`."""
    return tuple(1 << k for k in range(self.prefill_batch.bit_length()))

  @property
  def attention_windows(self) -> tuple[int, ...]:
    """Cache prefixes that decode steps attend over, ascending, the whole cache last. A step reads
    only the smallest one that covers its longest slot."""
    return tuple(sorted({w for w in self.short_attention_windows if w < self.cache_length})) + (self.cache_length,)

  def window_for(self, cache_end: int) -> int:
    """The smallest attention window that covers cache entries [0, cache_end)."""
    return next((w for w in self.attention_windows if w >= cache_end), self.cache_length)

  def bucket_for(self, length: int) -> int:
    if length < 1:
      raise ValueError("empty prompt: a request needs at least one prompt token")
    if length > self.max_prompt_length:
      raise ValueError(f"prompt of {length} tokens exceeds EngineConfig.max_prompt_length={self.max_prompt_length}")
    return next(b for b in self.prefill_buckets if b >= length)

  @property
  def extend_buckets(self) -> tuple[int, ...]:
    """Lengths an `extend` call pads its tokens to: powers of two from 8, and the whole cache."""
    out, size = [], 8
    while size < self.cache_length:
      out.append(size)
      size *= 2
    return (*out, self.cache_length)

  @property
  def resume_buckets(self) -> tuple[int, ...]:
    """Length buckets past max_prompt_length that only resumed requests use: powers of two, the cache last."""
    buckets, size = [], 1 << self.max_prompt_length.bit_length()
    while size < self.cache_length:
      buckets.append(size)
      size *= 2
    return tuple(buckets) + (self.cache_length,)

  def resume_bucket_for(self, length: int) -> int:
    """The length bucket of a resumed request's prefill (its prompt + tokens so far but the last), which may
    exceed max_prompt_length (then one of `resume_buckets`)."""
    if length <= self.max_prompt_length:
      return self.bucket_for(length)
    if length >= self.cache_length:
      raise ValueError(f"a resumed request of {length} tokens does not fit the cache of {self.cache_length} "
                       f"(max_prompt_length + max_new_tokens)")
    return next(b for b in self.resume_buckets if b >= length)


KV_LAYOUTS = ("contiguous", "paged")


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
  max_new: jax.Array
  stop_ids: jax.Array  # [rows, max_stop_tokens]


@flax.struct.dataclass
class StepOutput:
  """Per decode step j and slot s: the token sampled, its logprob, whether the slot was generating,
  and whether this token ended its request."""

  tokens: jax.Array  # [steps, S]
  logprobs: jax.Array
  active: jax.Array
  done: jax.Array


class Engine(Protocol):
  """What `StreamingSampler` calls: an engine on a mesh with a config, parameter placement, and JetStream's
  prefill / insert / generate over a pytree decode state (prefill and insert take up to
  `config.prefill_batch` prompts at once)."""

  config: EngineConfig
  mesh: Mesh

  def place_params(self, params): ...

  def init_decode_state(self) -> DecodeState: ...

  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None, version: int = 0) -> Prefix: ...

  def insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState: ...

  def generate(self, params, decode_state: DecodeState, window: int | None = None) -> tuple[DecodeState, StepOutput]:
    ...

  # Memory that rows take as they grow (the paged engine's); the contiguous engine has each slot's already.
  def check_request(self, prompt_length: int, max_new_tokens: int) -> None: ...

  def admissible(self, decode_state, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int: ...

  def make_room(self, decode_state, progress: dict[int, int]) -> tuple[object, list[int]]: ...

  def release(self, decode_state, slot: int): ...


def _stop_hit(tokens, stop_ids):
  return jnp.any((tokens[..., None] == stop_ids) & (stop_ids >= 0), axis=-1)


def sample_next(state, logits):
  """The sampling half of a decode step, the same for every engine: each active row's next token from
  `logits` [S, 1, vocab] with its key folded by its token count; returns (the changed row fields, StepOutput)."""
  active = state.active
  keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.rng), state.generated)
  tokens, logprobs = sample_tokens(logits[:, 0], keys, state.temperature, state.top_k, state.top_p)
  generated = state.generated + active
  done = active & (_stop_hit(tokens, state.stop_ids) | (generated >= state.max_new))
  changes = dict(last_token=jnp.where(active, tokens, state.last_token), generated=generated, active=active & ~done)
  return changes, StepOutput(tokens=tokens, logprobs=logprobs, active=active, done=done)


def first_tokens(last_logits, rng, temperature, top_k, top_p, max_new, stop_ids):
  """The first token of each request from its prompt's last logits [R, vocab], with key fold_in(rng, 0);
  returns (token, logprob, done)."""
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.wrap_key_data(r), 0))(rng)
  token, logprob = sample_tokens(last_logits, keys, temperature, top_k, top_p)
  return token, logprob, _stop_hit(token, stop_ids) | (max_new <= 1)


def device_memory_budget(device) -> int:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(1, len(jax.local_devices(backend=device.platform)))


class DecodeEngine(RowMoves):
  """An `Engine` for a `Transformer` on one mesh. Params are the model's `nnx.State`."""

  _sample_next = staticmethod(sample_next)

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    self.graphdef, self.model_config, self.config, self.mesh, self.rules = graphdef, model_config, config, mesh, rules
    self.memory = self._check_memory()
    self._state_shardings = self._decode_state_shardings()
    replicated = NamedSharding(mesh, PartitionSpec())
    self.launcher = launch.launcher(mesh)  # every program of this engine goes through it (see launch.py)
    jit = self.launcher.jit
    self._prefill = jit(self._prefill_impl, out_shardings=replicated)
    self._insert = jit(self._insert_impl, donate_argnums=(1,), out_shardings=self._state_shardings)
    self._generate = jit(self._generate_impl, static_argnums=(2,), donate_argnums=(1,),
                         out_shardings=(self._state_shardings, replicated))
    self._extend = jit(self._extend_impl, donate_argnums=(1,), out_shardings=(self._state_shardings, replicated))
    self._move = jit(self._move_impl, static_argnums=(4,), donate_argnums=(1,), out_shardings=self._state_shardings)

  # ---- placement and memory -------------------------------------------------------------------
  def place_params(self, params):
    """Puts an `nnx.State` of parameters onto this engine's mesh by the logical rules."""
    return launch.put(params, state_shardings(params, self.mesh, self.rules))

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
    param_bytes = mc.param_count() * jnp.dtype(mc.weight_dtype).itemsize
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
  def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
    """Raises, naming the key, when a request cannot run on this engine."""
    self.config.bucket_for(prompt_length)
    if max_new_tokens > self.config.max_new_tokens:
      raise ValueError(f"max_new_tokens={max_new_tokens} exceeds EngineConfig.max_new_tokens="
                       f"{self.config.max_new_tokens}")

  def admissible(self, decode_state, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int:
    """How many of `prompts` (in order) have the memory to start: all, a free slot is enough here."""
    return len(prompts)

  def make_room(self, decode_state, progress: dict[int, int]) -> tuple[DecodeState, list[int]]:
    """Memory for the busy slots' next `steps_per_sync` tokens: always there; nothing is preempted."""
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
        top_p=jnp.ones((s,), jnp.float32), max_new=jnp.ones((s,), jnp.int32),
        stop_ids=jnp.full((s, ec.max_stop_tokens), -1, jnp.int32))

  def init_decode_state(self) -> DecodeState:
    return self.launcher.jit(self._empty_state, out_shardings=self._state_shardings)()

  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None, version: int = 0) -> Prefix:
    """Runs up to `prefill_batch` prompts (unpadded int tokens) in one call and samples each one's first
    token with its key data `rngs[i]` [2]; rows are padded to the longest prompt's bucket, and their count
    to a row bucket (padding rows are computed and dropped). `resume[i] = (last token, tokens generated)`
    continues a request whose `prompts[i]` is its prompt + tokens so far but the last (preempted, handed
    over, or recomputed with new weights): that token is its next input, not sampled. `version` (of the
    weights) keys a prefix cache; this engine keeps none."""
    n = len(prompts)
    resume = list(resume) if resume is not None else [None] * n
    if not 1 <= n <= self.config.prefill_batch or len(samplings) != n or len(rngs) != n or len(resume) != n:
      raise ValueError(f"prefill takes 1..{self.config.prefill_batch} prompts with one SamplingParams, rng and "
                       f"resume each; got {n}, {len(samplings)}, {len(rngs)}, {len(resume)}")
    rows = next(r for r in self.config.row_buckets if r >= n)
    bucket = max(self.config.resume_bucket_for(len(p)) if r else self.config.bucket_for(len(p))
                 for p, r in zip(prompts, resume))
    tokens, lengths = np.zeros((rows, bucket), np.int32), np.ones((rows,), np.int32)
    keys, knobs = np.zeros((rows, 2), np.uint32), _Knobs(rows, self.config.max_stop_tokens)
    given, generated = np.full((rows,), -1, np.int32), np.ones((rows,), np.int32)
    for i, (prompt, sampling, rng) in enumerate(zip(prompts, samplings, rngs)):
      if sampling.max_new_tokens > self.config.max_new_tokens:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens} exceeds the engine's "
                         f"EngineConfig.max_new_tokens={self.config.max_new_tokens}")
      tokens[i, :len(prompt)], lengths[i], keys[i] = prompt, len(prompt), np.asarray(rng, np.uint32)
      knobs.set(i, sampling)
      if resume[i]:
        given[i], generated[i] = resume[i]
    return self._prefill(params, tokens, lengths, keys, given, generated, *knobs.arrays())

  def _prefill_impl(self, params, tokens, true_length, rng, given, generated, temperature, top_k, top_p, max_new,
                    stop_ids):
    model = nnx.merge(self.graphdef, params)
    rows, bucket = tokens.shape
    mask = jnp.arange(bucket)[None, :] < true_length[:, None]
    cache = KVCache.init(self.model_config, rows, bucket)
    logits, cache = model.forward_with_cache(tokens, cache, mask, logits_at=true_length - 1)
    token, logprob, done = first_tokens(logits[:, 0], rng, temperature, top_k, top_p, max_new, stop_ids)
    resumed = given >= 0
    return Prefix(keys=cache.keys, values=cache.values, valid=cache.valid, true_length=true_length,
                  first_token=jnp.where(resumed, given, token), first_logprob=jnp.where(resumed, 0.0, logprob),
                  done=done & ~resumed, generated=generated, rng=rng, temperature=temperature, top_k=top_k,
                  top_p=top_p, max_new=max_new, stop_ids=stop_ids)

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
    cache = cache.replace(
        keys=tuple(put_kv(k, pk) for k, pk in zip(cache.keys, prefix.keys)),
        values=tuple(put_kv(v, pv) for v, pv in zip(cache.values, prefix.values)),
        valid=put(cache.valid, row_valid), index=put(cache.index, prefix.true_length),
        next_position=put(cache.next_position, prefix.true_length))
    return state.replace(
        cache=cache, last_token=put(state.last_token, prefix.first_token), rng=put(state.rng, prefix.rng),
        generated=put(state.generated, prefix.generated), active=put(state.active, ~prefix.done),
        temperature=put(state.temperature, prefix.temperature), top_k=put(state.top_k, prefix.top_k),
        top_p=put(state.top_p, prefix.top_p), max_new=put(state.max_new, prefix.max_new),
        stop_ids=put(state.stop_ids, prefix.stop_ids))

  def generate(self, params, decode_state: DecodeState, window: int | None = None) -> tuple[DecodeState, StepOutput]:
    """`steps_per_sync` decode steps for every slot (inactive slots compute but change nothing).

    `window`, one of `config.attention_windows`, must exceed every active slot's last write
    (its cache index + steps_per_sync - 1); the default, the whole cache, always does.
    """
    window = self.config.cache_length if window is None else window
    if window not in self.config.attention_windows:
      raise ValueError(f"window {window} is not one of {self.config.attention_windows}")
    return self._generate(params, decode_state, window)

  def _generate_impl(self, params, state: DecodeState, window: int):
    model = nnx.merge(self.graphdef, params)

    def step(state: DecodeState, _):
      active = state.active
      logits, cache = model.forward_with_cache(state.last_token[:, None], state.cache, active[:, None], window)
      cache = cache.replace(index=jnp.where(active, cache.index, state.cache.index))
      changes, out = sample_next(state, logits)
      return state.replace(cache=cache, **changes), out

    return jax.lax.scan(step, state, None, length=self.config.steps_per_sync)



class _Knobs:
  """Per-row sampling knobs of a prefill call, as the arrays the jitted prefill takes."""

  def __init__(self, rows: int, max_stops: int):
    self.temperature, self.top_k = np.ones((rows,), np.float32), np.zeros((rows,), np.int32)
    self.top_p, self.max_new = np.ones((rows,), np.float32), np.ones((rows,), np.int32)
    self.stop_ids = np.full((rows, max_stops), -1, np.int32)

  def set(self, row: int, sampling: SamplingParams) -> None:
    if len(sampling.stop_token_ids) > self.stop_ids.shape[1]:
      raise ValueError(f"{len(sampling.stop_token_ids)} stop tokens exceed EngineConfig.max_stop_tokens="
                       f"{self.stop_ids.shape[1]}")
    self.temperature[row], self.top_k[row], self.top_p[row] = sampling.temperature, sampling.top_k, sampling.top_p
    self.max_new[row] = sampling.max_new_tokens
    self.stop_ids[row, :len(sampling.stop_token_ids)] = sampling.stop_token_ids

  def arrays(self) -> tuple:
    return self.temperature, self.top_k, self.top_p, self.max_new, self.stop_ids

