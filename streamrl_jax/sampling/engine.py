"""The decode engine: JetStream's engine shape (prefill / insert / generate) over a pytree decode state.

Slots are sharded over the mesh's "data" axis and parameters by the model's logical rules. Every
jitted function is built once here (the one jit boundary of an engine); prompts are padded to
power-of-two buckets, so an engine compiles at most `2 * len(prefill_buckets) + len(attention_windows)` programs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.models import KVCache, ModelConfig, kv_cache_bytes, logical_spec, state_shardings
from streamrl_jax.sampling.sample import sample_tokens
from streamrl_jax.types import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Slots and lengths of one engine instance."""

  num_slots: int = 8
  max_prompt_length: int = 64
  max_new_tokens: int = 64
  min_prefill_bucket: int = 16
  steps_per_sync: int = 1  # decode steps per host round trip
  max_stop_tokens: int = 4
  memory_budget_bytes: int = 0  # per device; 0: the device's own limit (host RAM share on CPU)
  # Cache prefixes shorter than the whole cache that a decode step may attend over when every slot
  # fits (one more compiled `generate` each). On accelerators powers of two pay off; on CPU, XLA
  # copies mid-size slices of the cache, which costs more than it saves, hence one short window.
  short_attention_windows: tuple[int, ...] = (64,)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "short_attention_windows":
        if any(w < 1 for w in value):
          raise ValueError(f"EngineConfig.short_attention_windows={value} must be positive")
      elif value < (0 if field.name == "memory_budget_bytes" else 1):
        raise ValueError(f"EngineConfig.{field.name}={value} is out of range")

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
  """A prefilled prompt and its first sampled token, ready to insert into a slot."""

  keys: tuple[jax.Array, ...]  # per layer [1, kv_heads, bucket, head_dim]
  values: tuple[jax.Array, ...]
  valid: jax.Array  # [1, bucket]
  true_length: jax.Array  # int32 scalar
  first_token: jax.Array
  first_logprob: jax.Array
  done: jax.Array  # bool: the first token already ends the request
  rng: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  max_new: jax.Array
  stop_ids: jax.Array  # [max_stop_tokens]


@flax.struct.dataclass
class StepOutput:
  """Per decode step j and slot s: the token sampled, its logprob, whether the slot was generating,
  and whether this token ended its request."""

  tokens: jax.Array  # [steps, S]
  logprobs: jax.Array
  active: jax.Array
  done: jax.Array


class Engine(Protocol):
  def init_decode_state(self) -> DecodeState: ...

  def prefill(self, params, tokens, true_length, *, sampling: SamplingParams, rng) -> Prefix: ...

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState: ...

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, StepOutput]: ...


def _stop_hit(tokens, stop_ids):
  return jnp.any((tokens[..., None] == stop_ids) & (stop_ids >= 0), axis=-1)


def device_memory_budget(device) -> int:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(1, len(jax.local_devices(backend=device.platform)))


class DecodeEngine:
  """An `Engine` for a `Transformer` on one mesh. Params are the model's `nnx.State`."""

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    self.graphdef, self.model_config, self.config, self.mesh, self.rules = graphdef, model_config, config, mesh, rules
    self.memory = self._check_memory()
    self._state_shardings = self._decode_state_shardings()
    replicated = NamedSharding(mesh, PartitionSpec())
    self._prefill = jax.jit(self._prefill_impl, out_shardings=replicated)
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self._state_shardings)
    self._generate = jax.jit(self._generate_impl, static_argnums=(2,), donate_argnums=(1,),
                             out_shardings=(self._state_shardings, replicated))

  # ---- placement and memory -------------------------------------------------------------------
  def place_params(self, params):
    """Puts an `nnx.State` of parameters onto this engine's mesh by the logical rules."""
    return jax.device_put(params, state_shardings(params, self.mesh, self.rules))

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
    return jax.jit(self._empty_state, out_shardings=self._state_shardings)()

  def prefill(self, params, tokens, true_length: int, *, sampling: SamplingParams, rng) -> Prefix:
    """Runs one prompt (unpadded int tokens) and samples its first token with key data `rng` [2]."""
    true_length = int(true_length)
    bucket = self.config.bucket_for(true_length)
    if len(sampling.stop_token_ids) > self.config.max_stop_tokens:
      raise ValueError(f"{len(sampling.stop_token_ids)} stop tokens exceed EngineConfig.max_stop_tokens="
                       f"{self.config.max_stop_tokens}")
    if sampling.max_new_tokens > self.config.max_new_tokens:
      raise ValueError(f"max_new_tokens={sampling.max_new_tokens} exceeds the engine's "
                       f"EngineConfig.max_new_tokens={self.config.max_new_tokens}")
    padded = np.zeros((1, bucket), np.int32)
    padded[0, :true_length] = np.asarray(tokens)[:true_length]
    stops = np.full((self.config.max_stop_tokens,), -1, np.int32)
    stops[: len(sampling.stop_token_ids)] = sampling.stop_token_ids
    knobs = (np.float32(sampling.temperature), np.int32(sampling.top_k), np.float32(sampling.top_p),
             np.int32(sampling.max_new_tokens), stops)
    return self._prefill(params, padded, np.int32(true_length), np.asarray(rng, np.uint32), *knobs)

  def _prefill_impl(self, params, tokens, true_length, rng, temperature, top_k, top_p, max_new, stop_ids):
    model = nnx.merge(self.graphdef, params)
    bucket = tokens.shape[1]
    mask = jnp.arange(bucket)[None, :] < true_length
    cache = KVCache.init(self.model_config, 1, bucket)
    logits, cache = model.forward_with_cache(tokens, cache, mask)
    last = jax.lax.dynamic_index_in_dim(logits[0], true_length - 1, keepdims=True)
    key = jax.random.fold_in(jax.random.wrap_key_data(rng), 0)
    token, logprob = sample_tokens(last, key[None], temperature[None], top_k[None], top_p[None])
    done = _stop_hit(token[0], stop_ids) | (max_new <= 1)
    return Prefix(keys=cache.keys, values=cache.values, valid=cache.valid, true_length=true_length,
                  first_token=token[0], first_logprob=logprob[0], done=done, rng=rng, temperature=temperature,
                  top_k=top_k, top_p=top_p, max_new=max_new, stop_ids=stop_ids)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    if not 0 <= slot < self.config.num_slots:
      raise ValueError(f"slot {slot} outside 0..{self.config.num_slots - 1}")
    return self._insert(prefix, decode_state, np.int32(slot))

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
    cache = state.cache
    put = lambda big, small: jax.lax.dynamic_update_slice(big, small.astype(big.dtype), (slot,) + (0,) * (big.ndim - 1))  # noqa: E731
    row_valid = jnp.zeros((1, cache.max_len), bool).at[:, : prefix.valid.shape[1]].set(prefix.valid)
    cache = cache.replace(
        keys=tuple(put(k, pk) for k, pk in zip(cache.keys, prefix.keys)),
        values=tuple(put(v, pv) for v, pv in zip(cache.values, prefix.values)),
        valid=put(cache.valid, row_valid), index=cache.index.at[slot].set(prefix.valid.shape[1]),
        next_position=cache.next_position.at[slot].set(prefix.true_length))
    return state.replace(
        cache=cache, last_token=state.last_token.at[slot].set(prefix.first_token),
        rng=state.rng.at[slot].set(prefix.rng), generated=state.generated.at[slot].set(1),
        active=state.active.at[slot].set(~prefix.done), temperature=state.temperature.at[slot].set(prefix.temperature),
        top_k=state.top_k.at[slot].set(prefix.top_k), top_p=state.top_p.at[slot].set(prefix.top_p),
        max_new=state.max_new.at[slot].set(prefix.max_new), stop_ids=state.stop_ids.at[slot].set(prefix.stop_ids))

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
      keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.rng), state.generated)
      tokens, logprobs = sample_tokens(logits[:, 0], keys, state.temperature, state.top_k, state.top_p)
      generated = state.generated + active
      done = active & (_stop_hit(tokens, state.stop_ids) | (generated >= state.max_new))
      new_state = state.replace(cache=cache, last_token=jnp.where(active, tokens, state.last_token),
                                generated=generated, active=active & ~done)
      return new_state, StepOutput(tokens=tokens, logprobs=logprobs, active=active, done=done)

    return jax.lax.scan(step, state, None, length=self.config.steps_per_sync)


def split_mesh(mesh: Mesh, devices_per_instance: list[int]) -> list[Mesh]:
  """Disjoint sub-meshes of `mesh` (its devices in order), each ("data", "fsdp", "tensor") with the
  parent's tensor size and the rest on "data"."""
  devices = list(mesh.devices.flat)
  if sum(devices_per_instance) > len(devices):
    raise ValueError(f"instances ask for {sum(devices_per_instance)} devices; the sampler mesh has {len(devices)}")
  tensor = mesh.shape.get("tensor", 1)
  out, start = [], 0
  for n in devices_per_instance:
    t = tensor if n % tensor == 0 else 1
    out.append(Mesh(np.asarray(devices[start:start + n]).reshape(n // t, 1, t), ("data", "fsdp", "tensor")))
    start += n
  return out
