"""The paged decode engine: rows keep their keys and values in fixed-size pages of one pool, taken as they
grow, so memory follows the tokens generated rather than `max_prompt_length + max_new_tokens` per slot.

- Pages are bookkept on the host in a `paged_cache.PageState` (reference counts, each row's page table, its
  length), changed only by the pure functions of `paged_cache` (reserve, fork, release), jitted on the CPU.
  The host therefore knows exactly what is free; the device gets each call's page tables as an argument.
- A prefill call prefills each distinct prompt once: requests with the same prompt tokens (a GRPO group)
  share its full pages (reference counted) and copy only its partly filled last page.
- Admission is by free pages (`admissible`): a request starts when pages remain for its prompt and a
  first `steps_per_sync` tokens. Before each decode call `make_room` reserves every busy row's next tokens;
  when the pool runs out, the row with the least progress is preempted (its pages freed); the driver
  queues it again and resumes it with a prefill of prompt + its tokens so far, so its tokens and
  log-probabilities are those of one continuous generation.

The pool's heads are split over "tensor"; rows are not split over "data" (more sampler replicas are the
data-parallel form). Compiles: prefill and insert one each per (distinct-prompt row bucket, request row
bucket, length bucket), generate one per attention window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.models import KVCache, ModelConfig, logical_spec, state_shardings
from streamrl_jax.models.paged_cache import (PagePool, PageState, advance, check_prompt_fits, copy_pages, fork,
                                             pages_for, release, reserve, reserve_rows, write_layer)
from streamrl_jax.sampling.engine import (EngineConfig, StepOutput, _Knobs, device_memory_budget, first_tokens,
                                          sample_next)
from streamrl_jax.types import SamplingParams


@flax.struct.dataclass
class PagedRows:
  """The device half of a paged engine's state: the page pool and every row's decode fields."""

  pool: PagePool
  length: jax.Array  # [S] int32: tokens the row holds in its pages
  last_token: jax.Array  # [S] int32
  rng: jax.Array  # [S, 2] uint32
  generated: jax.Array  # [S] int32
  active: jax.Array  # [S] bool
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  max_new: jax.Array
  stop_ids: jax.Array  # [S, max_stop_tokens]


@dataclasses.dataclass(frozen=True)
class PagedState:
  """A paged engine instance's state: the device rows and the host's page bookkeeping."""

  rows: PagedRows
  pages: PageState  # on the CPU: reference counts, tables, lengths (an upper bound while a call runs)


@flax.struct.dataclass
class GroupPrefill:
  """A prefill call's device outputs: distinct prompts' keys and values, and each request's first token."""

  keys: tuple[jax.Array, ...]  # per layer [U, kv_heads, bucket, head_dim]
  values: tuple[jax.Array, ...]
  valid: jax.Array  # [U, bucket]
  first_token: jax.Array  # [R]
  first_logprob: jax.Array
  done: jax.Array  # [R]
  rng: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  max_new: jax.Array
  stop_ids: jax.Array
  generated: jax.Array  # [R]: tokens already generated (1, or a resumed request's count)


@dataclasses.dataclass
class PagedPrefix:
  """What `prefill` hands to `insert`: the device outputs and, per request, its distinct prompt row, its
  length and whether it is that prompt's first request (the one that writes the pages)."""

  device: GroupPrefill
  source: list[int]
  lengths: list[int]
  leader: list[bool]

  @property
  def first_token(self):
    return self.device.first_token

  @property
  def first_logprob(self):
    return self.device.first_logprob

  @property
  def done(self):
    return self.device.done

  @property
  def valid(self):
    return self.device.valid


class PagedDecodeEngine:
  """An `Engine` over a page pool for a `Transformer` on one mesh. Params are the model's `nnx.State`."""

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    self.graphdef, self.model_config, self.config, self.mesh, self.rules = graphdef, model_config, config, mesh, rules
    self.page_size = config.page_size
    self.pages_per_row = config.cache_length // config.page_size
    self.num_pages = config.kv_pages or config.num_slots * self.pages_per_row
    if self.num_pages < self.pages_per_row:
      raise ValueError(f"EngineConfig.kv_pages={self.num_pages} holds {self.num_pages * self.page_size} tokens, "
                       f"fewer than one row at full length ({config.cache_length}); raise kv_pages")
    self.memory = self._check_memory()
    replicated = NamedSharding(mesh, PartitionSpec())
    self._shardings = self._state_shardings()
    self._prefill = jax.jit(self._prefill_impl, out_shardings=replicated)
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self._shardings)
    self._generate = jax.jit(self._generate_impl, static_argnums=(3,), donate_argnums=(1,),
                             out_shardings=(self._shardings, replicated))
    self._deactivate = jax.jit(lambda rows, slot: rows.replace(active=rows.active.at[slot].set(False)),
                               donate_argnums=(0,), out_shardings=self._shardings)
    self._cpu = jax.devices("cpu")[0]
    self._reserve = jax.jit(reserve, static_argnums=(3,))
    self._reserve_rows = jax.jit(reserve_rows, static_argnums=(3,))
    self._fork = jax.jit(fork, static_argnums=(3,))
    self._release = jax.jit(release)
    self._advance = jax.jit(advance)
    self.counters = dict(prefill_tokens=0, prompts_shared=0, preempted=0)

  # ---- placement and memory -------------------------------------------------------------------
  def place_params(self, params):
    return jax.device_put(params, state_shardings(params, self.mesh, self.rules))

  def _state_shardings(self):
    abstract = jax.eval_shape(self._empty_rows)

    def spec(x):
      names = (None, "kv_heads", None, "head_dim") if x.ndim == 4 else (None,) * x.ndim
      return NamedSharding(self.mesh, logical_spec(names, x.shape, self.mesh, self.rules))
    return jax.tree.map(spec, abstract)

  def page_bytes(self) -> int:
    mc = self.model_config
    return 2 * mc.num_layers * mc.num_kv_heads * self.page_size * mc.head_dim * jnp.dtype(mc.compute_dtype).itemsize

  def _check_memory(self) -> dict:
    mc, tensor = self.model_config, self.mesh.shape.get("tensor", 1)
    param_bytes = mc.param_count() * jnp.dtype(mc.weight_dtype).itemsize
    kv_bytes = self.num_pages * self.page_bytes()
    per_device = (param_bytes + kv_bytes) / tensor
    budget = self.config.memory_budget_bytes or device_memory_budget(self.mesh.devices.flat[0])
    if per_device > budget:
      raise ValueError(f"paged engine needs {per_device / 2**20:.1f} MiB per device ({param_bytes / 2**20:.1f} MiB of "
                       f"parameters, {self.num_pages} pages x {self.page_bytes() / 2**20:.3f} MiB, / tensor={tensor}) "
                       f"but the budget is {budget / 2**20:.1f} MiB; lower EngineConfig.kv_pages")
    return dict(param_bytes=param_bytes, kv_bytes=kv_bytes, kv_pages=self.num_pages, page_bytes=self.page_bytes(),
                bytes_per_device=int(per_device), budget_bytes_per_device=int(budget))

  # ---- state ------------------------------------------------------------------------------------
  def _empty_rows(self) -> PagedRows:
    s, ec = self.config.num_slots, self.config
    return PagedRows(
        pool=PagePool.init(self.model_config, self.num_pages, self.page_size), length=jnp.zeros((s,), jnp.int32),
        last_token=jnp.zeros((s,), jnp.int32), rng=jnp.zeros((s, 2), jnp.uint32), generated=jnp.zeros((s,), jnp.int32),
        active=jnp.zeros((s,), bool), temperature=jnp.ones((s,), jnp.float32), top_k=jnp.zeros((s,), jnp.int32),
        top_p=jnp.ones((s,), jnp.float32), max_new=jnp.ones((s,), jnp.int32),
        stop_ids=jnp.full((s, ec.max_stop_tokens), -1, jnp.int32))

  def init_decode_state(self) -> PagedState:
    rows = jax.jit(self._empty_rows, out_shardings=self._shardings)()
    pages = jax.device_put(PageState.init(self.num_pages, self.config.num_slots, self.pages_per_row), self._cpu)
    return PagedState(rows, pages)

  def free_pages(self, state: PagedState) -> int:
    return int(np.count_nonzero(np.asarray(state.pages.refcount) == 0))

  # ---- requests and memory ----------------------------------------------------------------------
  def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
    """Raises, naming the key, when a request cannot run on this engine."""
    check_prompt_fits(prompt_length, self.num_pages, self.page_size)
    self.config.bucket_for(prompt_length)
    if max_new_tokens > self.config.max_new_tokens:
      raise ValueError(f"max_new_tokens={max_new_tokens} exceeds EngineConfig.max_new_tokens="
                       f"{self.config.max_new_tokens}")

  def admissible(self, state: PagedState, prompts: Sequence, resumed: Sequence[int]) -> int:
    """How many of `prompts` (one prefill call's, in order) can start: pages must remain for each one's
    prompt and first `steps_per_sync` tokens; a request whose prompt an earlier one of the call has (not a
    resumed one, `resumed[i] > 0` tokens) needs only its partly filled last page and its first tokens."""
    free, seen, chunk, ps = self.free_pages(state), set(), self.config.steps_per_sync, self.page_size
    for i, (prompt, extra) in enumerate(zip(prompts, resumed)):
      length = len(prompt)
      key = tuple(np.asarray(prompt).tolist()) if not extra else None
      need = pages_for(length + chunk, ps) - (length // ps if key is not None and key in seen else 0)
      if need > free:
        return i
      free -= need
      if key is not None:
        seen.add(key)
    return len(prompts)

  def make_room(self, state: PagedState, progress: dict[int, int]) -> tuple[PagedState, list[int]]:
    """Reserves pages for every busy slot's next `steps_per_sync` tokens. While the pool cannot hold them, the
    slot with the least progress (`progress[slot]` tokens; ties: the highest slot) is preempted: its pages
    go back and its row stops. Returns (state, the preempted slots, in order)."""
    slots, preempted, pages = sorted(progress), [], state.pages
    while slots:
      need = np.asarray(pages.length)[slots] + self.config.steps_per_sync
      pages, ok = self._reserve_rows(pages, np.asarray(slots, np.int32), need.astype(np.int32), self.page_size)
      if np.asarray(ok).all():
        break
      victim = min(slots, key=lambda s: (progress[s], -s))
      slots.remove(victim)
      preempted.append(victim)
      pages = self._release(pages, victim)
      state = dataclasses.replace(state, rows=self._deactivate(state.rows, victim))
      self.counters["preempted"] += 1
    return dataclasses.replace(state, pages=pages), preempted

  def release(self, state: PagedState, slot: int) -> PagedState:
    """A finished slot's pages go back to the pool (shared ones once their last holder is done)."""
    return dataclasses.replace(state, pages=self._release(state.pages, slot))

  # ---- prefill / insert / generate --------------------------------------------------------------
  def _bucket(self, length: int) -> int:
    """A prompt's length bucket; a resumed prompt (prompt + tokens so far) may exceed max_prompt_length."""
    if length <= self.config.max_prompt_length:
      return self.config.bucket_for(length)
    return min(self.config.cache_length, 1 << (length - 1).bit_length())

  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None) -> PagedPrefix:
    """Prefills each distinct prompt of up to `prefill_batch` requests once and gives every request its first
    token (`rngs[i]`: its key data). `resume[i] = (last token, tokens generated)` continues a preempted request
    whose `prompts[i]` is its prompt + tokens so far but the last: that token is its next input, not sampled."""
    n, ec = len(prompts), self.config
    resume = list(resume) if resume is not None else [None] * n
    if not 1 <= n <= ec.prefill_batch or len(samplings) != n or len(rngs) != n or len(resume) != n:
      raise ValueError(f"prefill takes 1..{ec.prefill_batch} prompts with one SamplingParams, rng and resume each")
    distinct, source, leader = {}, [], []
    for i, prompt in enumerate(prompts):
      key = (tuple(np.asarray(prompt).tolist()), i if resume[i] else -1)
      leader.append(key not in distinct)
      source.append(distinct.setdefault(key, len(distinct)))
    uniques = [np.asarray(prompts[source.index(u)]) for u in range(len(distinct))]
    u_rows = next(r for r in ec.row_buckets if r >= len(uniques))
    m_rows = next(r for r in ec.row_buckets if r >= n)
    bucket = max(self._bucket(len(p)) for p in uniques)
    tokens, lengths = np.zeros((u_rows, bucket), np.int32), np.ones((u_rows,), np.int32)
    for u, prompt in enumerate(uniques):
      tokens[u, :len(prompt)], lengths[u] = prompt, len(prompt)
    keys, knobs = np.zeros((m_rows, 2), np.uint32), _Knobs(m_rows, ec.max_stop_tokens)
    src, given, generated = np.zeros((m_rows,), np.int32), np.full((m_rows,), -1, np.int32), np.ones((m_rows,), np.int32)
    for i, (sampling, rng) in enumerate(zip(samplings, rngs)):
      if sampling.max_new_tokens > ec.max_new_tokens:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens} exceeds EngineConfig.max_new_tokens="
                         f"{ec.max_new_tokens}")
      keys[i], src[i] = np.asarray(rng, np.uint32), source[i]
      knobs.set(i, sampling)
      if resume[i]:
        given[i], generated[i] = resume[i]
    self.counters["prefill_tokens"] += int(sum(len(p) for p in uniques))
    self.counters["prompts_shared"] += n - len(uniques)
    device = self._prefill(params, tokens, lengths, src, given, generated, keys, *knobs.arrays())
    return PagedPrefix(device, source, [int(len(uniques[s])) for s in source], leader)

  def _prefill_impl(self, params, tokens, true_length, source, given, generated, rng, temperature, top_k, top_p,
                    max_new, stop_ids):
    model = nnx.merge(self.graphdef, params)
    rows, bucket = tokens.shape
    mask = jnp.arange(bucket)[None, :] < true_length[:, None]
    logits, cache = model.forward_with_cache(tokens, KVCache.init(self.model_config, rows, bucket), mask,
                                             logits_at=true_length - 1)
    token, logprob, done = first_tokens(logits[source, 0], rng, temperature, top_k, top_p, max_new, stop_ids)
    resumed = given >= 0
    return GroupPrefill(keys=cache.keys, values=cache.values, valid=cache.valid,
                        first_token=jnp.where(resumed, given, token), first_logprob=jnp.where(resumed, 0.0, logprob),
                        done=done & ~resumed, rng=rng, temperature=temperature, top_k=top_k, top_p=top_p,
                        max_new=max_new, stop_ids=stop_ids, generated=generated)

  def insert(self, prefix: PagedPrefix, state: PagedState, slots: Sequence[int]) -> PagedState:
    """Request i of `prefix` takes slot `slots[i]`: a prompt's first request takes pages for it and writes
    them; the others share its full pages and copy its partly filled last one. The slots must be free and
    `admissible` must have said the pages are there."""
    n, num_slots = len(prefix.source), self.config.num_slots
    if len(slots) != n or len(set(slots)) != n or any(not 0 <= s < num_slots for s in slots):
      raise ValueError(f"insert takes {n} distinct slots in 0..{num_slots - 1}, got {list(slots)}")
    rows = prefix.device.first_token.shape[0]
    targets = np.full((rows,), num_slots, np.int32)
    targets[:n] = slots
    lengths, leaders = np.zeros((rows,), np.int32), np.zeros((rows,), bool)
    copy_from, copy_to = np.full((rows,), -1, np.int32), np.full((rows,), -1, np.int32)
    pages, slot_of_source = state.pages, {}
    for i, slot in enumerate(slots):
      source, length = prefix.source[i], prefix.lengths[i]
      lengths[i] = length
      if prefix.leader[i]:
        pages, ok = self._reserve(pages, slot, length, self.page_size)
        pages = self._advance(pages, np.eye(num_slots, dtype=np.int32)[slot] * length)
        slot_of_source[source], leaders[i] = slot, True
      else:
        pages, ok, copy_from[i], copy_to[i] = self._fork(pages, slot_of_source[source], slot, self.page_size)
      if not bool(ok):
        raise RuntimeError(f"the page pool ran out inserting into slot {slot}; `admissible` should have held it back")
    table = np.asarray(pages.table)[np.minimum(targets, num_slots - 1)]
    new_rows = self._insert(prefix.device, state.rows, targets, table, leaders, lengths,
                            np.asarray(prefix.source + [0] * (rows - n), np.int32), copy_from, copy_to)
    return PagedState(new_rows, pages)

  def _insert_impl(self, prefix: GroupPrefill, rows: PagedRows, slots, table, leaders, lengths, source, copy_from,
                   copy_to):
    bucket = prefix.valid.shape[1]
    write = leaders[:, None] & (jnp.arange(bucket)[None, :] < lengths[:, None])
    start = jnp.zeros_like(lengths)
    pool = rows.pool
    new_k, new_v = [], []
    for k_pages, v_pages, k, v in zip(pool.keys, pool.values, prefix.keys, prefix.values):
      k_tok, v_tok = k[source].transpose(0, 2, 1, 3), v[source].transpose(0, 2, 1, 3)  # [R, bucket, kv, d]
      k_pages, v_pages = write_layer(k_pages, v_pages, table, start, k_tok, v_tok, write)
      new_k.append(k_pages)
      new_v.append(v_pages)
    pool = copy_pages(pool.replace(keys=tuple(new_k), values=tuple(new_v)), copy_from, copy_to)
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    return rows.replace(
        pool=pool, length=put(rows.length, lengths), last_token=put(rows.last_token, prefix.first_token),
        rng=put(rows.rng, prefix.rng), generated=put(rows.generated, prefix.generated),
        active=put(rows.active, ~prefix.done), temperature=put(rows.temperature, prefix.temperature),
        top_k=put(rows.top_k, prefix.top_k), top_p=put(rows.top_p, prefix.top_p),
        max_new=put(rows.max_new, prefix.max_new), stop_ids=put(rows.stop_ids, prefix.stop_ids))

  def generate(self, params, state: PagedState, window: int | None = None) -> tuple[PagedState, StepOutput]:
    """`steps_per_sync` decode steps for every row; `make_room` must have reserved their pages. `window`, one
    of `config.attention_windows`, must exceed every active row's last write."""
    window = self.config.cache_length if window is None else window
    if window not in self.config.attention_windows:
      raise ValueError(f"window {window} is not one of {self.config.attention_windows}")
    table = np.asarray(state.pages.table)
    rows, out = self._generate(params, state.rows, table, window)
    busy = (table[:, 0] >= 0).astype(np.int32)  # rows holding pages; lengths become an upper bound
    return PagedState(rows, self._advance(state.pages, busy * self.config.steps_per_sync)), out

  def _generate_impl(self, params, rows: PagedRows, table, window: int):
    model = nnx.merge(self.graphdef, params)
    table = table[:, :window // self.page_size]

    def step(rows: PagedRows, _):
      active = rows.active
      logits, pool = model.forward_paged(rows.last_token[:, None], rows.pool, table, rows.length, active[:, None],
                                         window)
      changes, out = sample_next(rows, logits)
      return rows.replace(pool=pool, length=rows.length + active, **changes), out

    return jax.lax.scan(step, rows, None, length=self.config.steps_per_sync)

