"""What every decode engine shares, whatever its KV layout: the `Engine` protocol the sampler calls, the step
output, the sampling half of a decode step, the per-request arrays of a prefill call, parameter placement,
request and window checks, and the host loop that batches row operations into calls of a row bucket.

An engine subclasses `EngineBase` and supplies its state, its jitted programs and the layout's memory check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from streamrl_jax import launch
from streamrl_jax.models import ModelConfig, state_shardings
from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.sampling.token_sampling import sample_tokens
from streamrl_jax.types import SamplingParams


@flax.struct.dataclass
class StepOutput:
  """Per decode step j and slot s: the token sampled, its logprob, whether the slot was generating, whether this
  token ended its request, and in a mixture of experts the experts that routed the step's input token."""

  tokens: jax.Array  # [steps, S]
  logprobs: jax.Array
  active: jax.Array
  done: jax.Array
  routes: jax.Array | None = None  # a mixture: [steps, S, sparse layers, k] experts the step's input token took


class Engine(Protocol):
  """What `StreamingSampler` calls: an engine on a mesh with a config, parameter placement, and JetStream's
  prefill / insert / generate over a pytree decode state (prefill and insert take up to
  `config.prefill_batch` prompts at once); memory as rows grow; and the multi-turn row operations (`extend` a
  paused row with a tool's tokens, `park` it off its slot while the tool runs and `unpark` it back)."""

  config: EngineConfig
  mesh: Mesh

  def place_params(self, params): ...

  def init_decode_state(self): ...

  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None, version: int = 0): ...

  def insert(self, prefix, decode_state, slots: Sequence[int]): ...

  def generate(self, params, decode_state, window: int | None = None) -> tuple[object, StepOutput]: ...

  def check_request(self, prompt_length: int, max_new_tokens: int) -> None: ...

  def admissible(self, decode_state, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int: ...

  def make_room(self, decode_state, progress: dict[int, int]) -> tuple[object, list[int]]: ...

  def release(self, decode_state, slot: int): ...

  def extend_room(self, decode_state, rows: dict[int, int]) -> tuple[object, list[int]]: ...

  def extend(self, params, decode_state, slots: Sequence[int], tokens: Sequence[Sequence[int]]): ...

  def init_parking(self): ...

  def park(self, decode_state, parking, slots: Sequence[int], places: Sequence[int]) -> tuple[object, object]: ...

  def unpark(self, decode_state, parking, places: Sequence[int], slots: Sequence[int]) -> tuple[object, object]: ...

  def drop_parked(self, decode_state, parking, place: int) -> tuple[object, object]: ...


def _stop_hit(tokens, stop_ids):
  return jnp.any((tokens[..., None] == stop_ids) & (stop_ids >= 0), axis=-1)


def sample_next(state, logits):
  """The sampling half of a decode step, the same for every engine: each active row's next token from
  `logits` [S, 1, vocab] with its key folded by its token count; returns (the changed row fields, StepOutput)."""
  active = state.active
  keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.rng), state.generated)
  tokens, logprobs = sample_tokens(logits[:, 0], keys, state.temperature, state.top_k, state.top_p, state.min_p)
  generated = state.generated + active
  done = active & (_stop_hit(tokens, state.stop_ids) | (generated >= state.max_new))
  changes = dict(last_token=jnp.where(active, tokens, state.last_token), generated=generated, active=active & ~done)
  return changes, StepOutput(tokens=tokens, logprobs=logprobs, active=active, done=done)


def first_tokens(last_logits, rng, temperature, top_k, top_p, min_p, max_new, stop_ids):
  """The first token of each request from its prompt's last logits [R, vocab], with key fold_in(rng, 0);
  returns (token, logprob, done)."""
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.wrap_key_data(r), 0))(rng)
  token, logprob = sample_tokens(last_logits, keys, temperature, top_k, top_p, min_p)
  return token, logprob, _stop_hit(token, stop_ids) | (max_new <= 1)


def device_memory_budget(device) -> int:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(1, len(jax.local_devices(backend=device.platform)))


class PlannedCall(NamedTuple):
  """An engine's program lowered for a plan (`streamrl plan`), and whether the decode state is among its arguments
  (else it is held beside the program while it runs)."""

  lowered: object  # jax.stages.Lowered
  reads_state: bool


def shapes_of(make: Callable, shardings):
  """The shapes `make()` gives, each with its sharding: an engine's decode state for a plan, no value made."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(make), shardings)


def planned_requests(config: EngineConfig, vocab_size: int) -> tuple[list, list, list]:
  """(prompts, samplings, rngs) of a plan's largest prefill call: `prefill_batch` distinct prompts of
  `max_prompt_length` tokens, each generating `max_new_tokens`."""
  n, length = config.prefill_batch, config.max_prompt_length
  prompts = [(np.arange(length) + i) % vocab_size for i in range(n)]
  return prompts, [SamplingParams(max_new_tokens=config.max_new_tokens)] * n, [np.zeros(2, np.uint32)] * n


@flax.struct.dataclass
class RequestArrays:
  """A prefill call's per-request arrays over its padded rows: key data, sampling knobs, and the resume state
  (`given` >= 0: a resumed request's next input token; `generated`: its tokens so far)."""

  rng: np.ndarray  # [rows, 2] uint32
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray
  min_p: np.ndarray
  max_new: np.ndarray
  stop_ids: np.ndarray  # [rows, max_stop_tokens], -1 padded
  given: np.ndarray  # [rows] int32, -1: sample the first token
  generated: np.ndarray  # [rows] int32

  @property
  def knobs(self) -> tuple:
    """(rng, temperature, top_k, top_p, min_p, max_new, stop_ids): what `first_tokens` takes."""
    return self.rng, self.temperature, self.top_k, self.top_p, self.min_p, self.max_new, self.stop_ids


class EngineBase:
  """The layout-free half of an engine: config checks, parameter placement, a prefill call's request arrays,
  and the row-bucketed host loops of `extend`, `park` and `unpark` (each layout's jitted `_extend_call` and
  `_move_rows` do the device work)."""

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    self.graphdef, self.model_config, self.config, self.mesh, self.rules = graphdef, model_config, config, mesh, rules
    self.routed = model_config.num_experts > 0  # a mixture: every call also gives the experts each token took
    self.launcher = launch.launcher(mesh)  # every program of this engine goes through it (see launch.py)

  def place_params(self, params):
    """Puts an `nnx.State` of parameters onto this engine's mesh by the logical rules."""
    return launch.put(params, state_shardings(params, self.mesh, self.rules))

  def param_bytes(self) -> int:
    mc = self.model_config
    return mc.param_count() * jnp.dtype(mc.weight_dtype).itemsize

  # ---- requests -----------------------------------------------------------------------------------
  def _check_prompt_fits(self, prompt_length: int) -> None:
    """A layout's own bound on a prompt (the paged pool's size); none by default."""

  def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
    """Raises, naming the key, when a request cannot run on this engine."""
    self._check_prompt_fits(prompt_length)
    self.config.bucket_for(prompt_length)
    self._check_max_new(max_new_tokens)

  def _check_max_new(self, max_new_tokens: int) -> None:
    if max_new_tokens > self.config.max_new_tokens:
      raise ValueError(f"max_new_tokens={max_new_tokens} exceeds EngineConfig.max_new_tokens="
                       f"{self.config.max_new_tokens}")

  def request_arrays(self, samplings: Sequence[SamplingParams], rngs: Sequence,
                     resume: Sequence[tuple[int, int] | None]) -> RequestArrays:
    """The arrays of a prefill call of `len(samplings)` requests (1..prefill_batch, one key and resume each),
    padded to its row bucket; raises naming what is out of range."""
    n, ec = len(samplings), self.config
    if not 1 <= n <= ec.prefill_batch or len(rngs) != n or len(resume) != n:
      raise ValueError(f"prefill takes 1..{ec.prefill_batch} prompts with one SamplingParams, rng and resume each; "
                       f"got {n}, {len(rngs)}, {len(resume)}")
    rows = ec.row_bucket_for(n)
    out = RequestArrays(
        rng=np.zeros((rows, 2), np.uint32), temperature=np.ones((rows,), np.float32), top_k=np.zeros((rows,), np.int32),
        top_p=np.ones((rows,), np.float32), min_p=np.zeros((rows,), np.float32), max_new=np.ones((rows,), np.int32),
        stop_ids=np.full((rows, ec.max_stop_tokens), -1, np.int32), given=np.full((rows,), -1, np.int32),
        generated=np.ones((rows,), np.int32))
    for i, (sampling, rng, resumed) in enumerate(zip(samplings, rngs, resume)):
      self._check_max_new(sampling.max_new_tokens)
      if len(sampling.stop_token_ids) > ec.max_stop_tokens:
        raise ValueError(f"{len(sampling.stop_token_ids)} stop tokens exceed EngineConfig.max_stop_tokens="
                         f"{ec.max_stop_tokens}")
      out.rng[i] = np.asarray(rng, np.uint32)
      out.temperature[i], out.top_k[i], out.top_p[i] = sampling.temperature, sampling.top_k, sampling.top_p
      out.min_p[i] = sampling.min_p
      out.max_new[i] = sampling.max_new_tokens
      out.stop_ids[i, :len(sampling.stop_token_ids)] = sampling.stop_token_ids
      if resumed:
        out.given[i], out.generated[i] = resumed
    return out

  def _window(self, window: int | None) -> int:
    window = self.config.cache_length if window is None else window
    if window not in self.config.attention_windows:
      raise ValueError(f"window {window} is not one of {self.config.attention_windows}")
    return window

  def _steps(self, steps: int | None) -> int:
    steps = self.config.steps_per_sync if steps is None else steps
    if steps not in self.config.step_options:
      raise ValueError(f"a decode call of {steps} steps is not one of {self.config.step_options}")
    return steps

  # ---- multi-turn rows ----------------------------------------------------------------------------
  def extend(self, params, decode_state, slots: Sequence[int], tokens: Sequence[Sequence[int]]):
    """Appends `tokens[i]` to the paused row in slot `slots[i]` (a row a stop token ended: the first of its
    tokens is that stop token, the rest a tool's output) with one prefill of just those tokens over the row's
    cache, the history not prefilled again; then samples each row's next token and makes it active again.
    `extend_room` must have made room for them. Only those rows are computed, up to `prefill_batch` a call.
    Returns (state, [((token, logprob, done) device arrays of a call, row)] one entry per slot): no device op
    runs outside the calls. Compiles once per row bucket and `extend_buckets` length."""
    num_slots, ec = self.config.num_slots, self.config
    if len(slots) != len(tokens) or len(set(slots)) != len(slots) or any(not 0 <= s < num_slots for s in slots):
      raise ValueError(f"extend takes distinct slots in 0..{num_slots - 1}, one token list each; got {list(slots)}")
    if not slots or min(len(t) for t in tokens) < 1 or max(len(t) for t in tokens) > ec.cache_length:
      raise ValueError(f"extend appends 1..{ec.cache_length} tokens to each of 1 or more rows, got "
                       f"lengths {[len(t) for t in tokens]}")
    outputs = []
    for start in range(0, len(slots), ec.prefill_batch):
      part, rows_tokens = slots[start:start + ec.prefill_batch], tokens[start:start + ec.prefill_batch]
      rows = ec.row_bucket_for(len(part))
      bucket = next(b for b in ec.extend_buckets if b >= max(len(t) for t in rows_tokens))
      chunk, lengths = np.zeros((rows, bucket), np.int32), np.zeros((rows,), np.int32)
      targets = np.full((rows,), num_slots, np.int32)  # padding rows: out of range, dropped when put back
      for i, (slot, row) in enumerate(zip(part, rows_tokens)):
        chunk[i, :len(row)], lengths[i], targets[i] = row, len(row), slot
      decode_state, out = self._extend_call(params, decode_state, targets, chunk, lengths)
      outputs += [(out, row) for row in range(len(part))]
    return decode_state, outputs

  def _extend_call(self, params, decode_state, targets, chunk, lengths):
    raise NotImplementedError

  def row_calls(self, sources: Sequence[int], targets: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(source rows, target rows) index arrays of up to `prefill_batch` rows, padded to a row bucket (padding
    targets out of range: dropped)."""
    if len(sources) != len(targets) or len(set(targets)) != len(targets):
      raise ValueError(f"rows to move: {list(sources)} -> {list(targets)}")
    out, ec = [], self.config
    for start in range(0, len(sources), ec.prefill_batch):
      part = list(zip(sources, targets))[start:start + ec.prefill_batch]
      rows = ec.row_bucket_for(len(part))
      a, b = np.zeros((rows,), np.int32), np.full((rows,), ec.num_slots, np.int32)
      a[:len(part)], b[:len(part)] = zip(*part)
      out.append((a, b))
    return out
