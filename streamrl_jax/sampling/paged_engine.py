"""The paged decode engine: rows keep their keys and values in fixed-size pages of one pool, taken as they
grow, so memory follows the tokens generated rather than `max_prompt_length + max_new_tokens` per slot.

- Pages are bookkept on the host in a `paged_cache.PageState` (reference counts, each row's page table, its
  length), changed only by the pure functions of `paged_cache` (reserve, fork, release), jitted on the CPU.
  The host therefore knows exactly what is free; the device gets each call's page tables as an argument.
- A prompt is prefilled once: requests with the same prompt tokens (a GRPO group) share its full pages
  (reference counted) and copy only its partly filled last page. A prompt's pages and last logits stay in a
  prefix cache keyed by (prompt tokens, weight version) while pages allow (`EngineConfig.prefix_cache_rows`
  entries, least recently used evicted first), so a group admitted over several calls is prefilled once; a
  new weight version drops the older entries (a prefix is never reused after the weights change).
- Admission is by free pages (`admissible`): a request starts when pages remain for its prompt and a
  first `steps_per_sync` tokens. Before each decode call `make_room` reserves every busy row's next tokens;
  when the pool runs out, the row with the least progress is preempted (its pages freed); the driver
  queues it again and resumes it with a prefill of prompt + its tokens so far, so its tokens and
  log-probabilities are those of one continuous generation.

The pool's heads are split over "tensor"; rows are not split over "data" (more sampler replicas are the
data-parallel form). Compiles: prefill and insert one each per (distinct-prompt row bucket, request row
bucket, length bucket), generate one per (busy-row bucket: a power of two up to num_slots, attention window).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import launch
from streamrl_jax.models import KVCache, ModelConfig, logical_spec, state_shardings
from streamrl_jax.models.paged_cache import (PagePool, PageState, advance, check_prompt_fits, copy_pages, fork,
                                             pages_for, release, reserve, reserve_rows, write_layer)
from streamrl_jax.sampling.engine import (EngineConfig, StepOutput, _Knobs, device_memory_budget, first_tokens,
                                          sample_next)
from streamrl_jax.sampling.paged_prefill import FirstTokens, InsertPlan, PagedPrefix, one_hot
from streamrl_jax.types import SamplingParams


@flax.struct.dataclass
class PagedRows:
  """The device half of a paged engine's state: the page pool, every row's decode fields, and the last
  logits of each prefix-cache entry."""

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
  prefix_logits: jax.Array  # [C, vocab] float32: the last prompt token's logits of cache entry c


@dataclasses.dataclass(frozen=True)
class PagedState:
  """A paged engine instance's state: the device rows and, on the host, the page bookkeeping (rows
  0..S-1 are the slots, S..S+C-1 the prefix-cache entries) and the cache's keys in use order."""

  rows: PagedRows
  pages: PageState  # on the CPU: reference counts, tables, lengths (an upper bound while a call runs)
  cache: tuple = ()  # ((prompt tokens, version), cache row), least recently used first


class PagedDecodeEngine:
  """An `Engine` over a page pool for a `Transformer` on one mesh. Params are the model's `nnx.State`."""

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    self.graphdef, self.model_config, self.config, self.mesh, self.rules = graphdef, model_config, config, mesh, rules
    self.page_size = config.page_size
    self.pages_per_row = config.cache_length // config.page_size
    self.num_pages = config.kv_pages or config.num_slots * self.pages_per_row
    self.cache_rows = config.prefix_cache_rows if config.share_prompts else 0
    if self.num_pages < self.pages_per_row:
      raise ValueError(f"EngineConfig.kv_pages={self.num_pages} holds {self.num_pages * self.page_size} tokens, "
                       f"fewer than one row at full length ({config.cache_length}); raise kv_pages")
    self.memory = self._check_memory()
    replicated = NamedSharding(mesh, PartitionSpec())
    self._shardings = self._state_shardings()
    self.launcher = launch.launcher(mesh)  # every program on the mesh goes through it (see launch.py)
    jit = self.launcher.jit
    self._insert = jit(self._insert_impl, donate_argnums=(1,), out_shardings=(self._shardings, replicated))
    self._generate = jit(self._generate_impl, static_argnums=(4,), donate_argnums=(1,),
                         out_shardings=(self._shardings, replicated))
    self._deactivate = jit(lambda rows, slot: rows.replace(active=rows.active.at[slot].set(False)),
                           donate_argnums=(0,), out_shardings=self._shardings)
    # The page table's programs run on one host device: a single-device program needs no launcher.
    self._cpu = jax.devices("cpu")[0]
    self._reserve = jax.jit(reserve, static_argnums=(3,))
    self._reserve_rows = jax.jit(reserve_rows, static_argnums=(3,))
    self._fork = jax.jit(fork, static_argnums=(3,))
    self._release = jax.jit(release)
    self._advance = jax.jit(advance)
    # prefill_tokens: prompts prefilled; resume_prefill_tokens: preempted requests' prompt + tokens, again
    self.counters = dict(prefill_tokens=0, resume_prefill_tokens=0, prompts_shared=0, prefix_cache_hits=0,
                         preempted=0, evicted=0)

  # ---- placement and memory -------------------------------------------------------------------
  def place_params(self, params):
    return launch.put(params, state_shardings(params, self.mesh, self.rules))

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
        stop_ids=jnp.full((s, ec.max_stop_tokens), -1, jnp.int32),
        prefix_logits=jnp.zeros((max(1, self.cache_rows), self.model_config.vocab_size), jnp.float32))

  def init_decode_state(self) -> PagedState:
    rows = self.launcher.jit(self._empty_rows, out_shardings=self._shardings)()
    pages = PageState.init(self.num_pages, self.config.num_slots + self.cache_rows, self.pages_per_row)
    return PagedState(rows, jax.device_put(pages, self._cpu))

  def free_pages(self, state: PagedState) -> int:
    return int(np.count_nonzero(np.asarray(state.pages.refcount) == 0))

  def _evictable_pages(self, state: PagedState, keep=()) -> int:
    """Pages that only prefix-cache entries (but those of `keep`) hold: what evicting them would free."""
    refcount, table = np.asarray(state.pages.refcount), np.asarray(state.pages.table)
    held = collections.Counter(int(p) for key, row in state.cache if key not in keep for p in table[row] if p >= 0)
    return sum(1 for page, n in held.items() if refcount[page] == n)

  def _evict(self, state: PagedState, wanted_free: int, keep=()) -> PagedState:
    """Drops prefix-cache entries, least recently used first (not those in `keep`), until `wanted_free` pages
    are free or none is left."""
    cache, pages = list(state.cache), state.pages
    for entry in list(cache):
      if int(np.count_nonzero(np.asarray(pages.refcount) == 0)) >= wanted_free:
        break
      if entry[0] in keep:
        continue
      pages = self._release(pages, entry[1])
      cache.remove(entry)
      self.counters["evicted"] += 1
    return dataclasses.replace(state, pages=pages, cache=tuple(cache))

  def drop_prefix_cache(self, state: PagedState) -> PagedState:
    """Every prefix-cache entry's pages go back to the pool."""
    pages = state.pages
    for _, row in state.cache:
      pages = self._release(pages, row)
    return PagedState(state.rows, pages, ())

  # ---- requests and memory ----------------------------------------------------------------------
  def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
    """Raises, naming the key, when a request cannot run on this engine."""
    check_prompt_fits(prompt_length, self.num_pages, self.page_size)
    self.config.bucket_for(prompt_length)
    if max_new_tokens > self.config.max_new_tokens:
      raise ValueError(f"max_new_tokens={max_new_tokens} exceeds EngineConfig.max_new_tokens="
                       f"{self.config.max_new_tokens}")

  def _needs(self, state: PagedState, prompts: Sequence, keys: Sequence) -> list[int]:
    """Pages each request of a call takes for its prompt and first `steps_per_sync` tokens: all of them for a
    prompt prefilled here; beyond the shared full pages for one an earlier request or the cache holds."""
    chunk, ps, seen = self.config.steps_per_sync, self.page_size, {k for k, _ in state.cache}
    out = []
    for prompt, key in zip(prompts, keys):
      length = len(prompt)
      out.append(pages_for(length + chunk, ps) - (length // ps if key is not None and key in seen else 0))
      if key is not None:
        seen.add(key)
    return out

  def admissible(self, state: PagedState, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int:
    """How many of `prompts` (one prefill call's, in order) can start: after the busy rows' next
    `steps_per_sync` tokens, pages must remain (free, or held only by the prefix cache) for each one's prompt
    and first tokens (`_needs`). A run of one prompt's requests is not cut unless it starts the call."""
    slots, chunk = self.config.num_slots, self.config.steps_per_sync
    length, held = np.asarray(state.pages.length)[:slots], np.asarray(state.pages.pages_held())[:slots]
    growth = int(np.maximum(pages_for(length + chunk, self.page_size) - held, 0)[held > 0].sum())
    keys = self._keys(prompts, resumed, version)
    free = self.free_pages(state) + self._evictable_pages(state, keep=set(keys)) - growth
    for i, need in enumerate(self._needs(state, prompts, keys)):
      if need > free:
        run = i  # do not cut a run of one prompt's requests (a group shares one prefill) unless it is the first
        while run > 0 and keys[i] is not None and keys[run - 1] == keys[i]:
          run -= 1
        return run or i
      free -= need
    return len(prompts)

  def _keys(self, prompts, resumed, version) -> list:
    return [(tuple(np.asarray(p).tolist()), version) if not extra and self.config.share_prompts else None
            for p, extra in zip(prompts, resumed)]

  def make_room(self, state: PagedState, progress: dict[int, int]) -> tuple[PagedState, list[int]]:
    """Reserves pages for every busy slot's next `steps_per_sync` tokens. While the pool cannot hold them,
    prefix-cache entries go first, then the slot with the least progress (`progress[slot]` tokens; ties: the
    highest slot) is preempted: its pages go back and its row stops. Returns (state, the preempted slots)."""
    slots, preempted = sorted(progress), []
    while slots:
      need = np.asarray(state.pages.length)[slots] + self.config.steps_per_sync
      pages, ok = self._reserve_rows(state.pages, np.asarray(slots, np.int32), need.astype(np.int32), self.page_size)
      state = dataclasses.replace(state, pages=pages)
      if np.asarray(ok).all():
        break
      if state.cache:  # cached prefixes go before any row: until one more page is free
        state = self._evict(state, self.free_pages(state) + 1)
        continue
      victim = min(slots, key=lambda s: (progress[s], -s))
      slots.remove(victim)
      preempted.append(victim)
      state = PagedState(self._deactivate(state.rows, victim), self._release(state.pages, victim), state.cache)
      self.counters["preempted"] += 1
    return state, preempted

  def release(self, state: PagedState, slot: int) -> PagedState:
    """A finished slot's pages go back to the pool (shared ones once their last holder is done)."""
    return dataclasses.replace(state, pages=self._release(state.pages, slot))

  # ---- prefill / insert / generate --------------------------------------------------------------
  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None, version: int = 0) -> PagedPrefix:
    """Plans a call of up to `prefill_batch` requests (`rngs[i]`: request i's key data); `insert` prefills each
    distinct prompt the prefix cache does not hold for `version` once. `resume[i] = (last token, tokens
    generated)` continues a preempted request whose `prompts[i]` is its prompt + tokens so far but the last:
    that token is its next input, not sampled."""
    n, ec = len(prompts), self.config
    resume = list(resume) if resume is not None else [None] * n
    if not 1 <= n <= ec.prefill_batch or len(samplings) != n or len(rngs) != n or len(resume) != n:
      raise ValueError(f"prefill takes 1..{ec.prefill_batch} prompts with one SamplingParams, rng and resume each")
    rows = next(r for r in ec.row_buckets if r >= n)
    keys, knobs = np.zeros((rows, 2), np.uint32), _Knobs(rows, ec.max_stop_tokens)
    for i, (sampling, rng) in enumerate(zip(samplings, rngs)):
      if sampling.max_new_tokens > ec.max_new_tokens:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens} exceeds EngineConfig.max_new_tokens="
                         f"{ec.max_new_tokens}")
      keys[i] = np.asarray(rng, np.uint32)
      knobs.set(i, sampling)
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    return PagedPrefix(prompts, self._keys(prompts, [bool(r) for r in resume], version), resume,
                       (keys, *knobs.arrays()), max(self.config.resume_bucket_for(len(p)) for p in prompts), params)

  def insert(self, prefix: PagedPrefix, state: PagedState, slots: Sequence[int]) -> PagedState:
    """Request i of `prefix` takes slot `slots[i]`. A prompt neither the cache nor an earlier request holds is
    prefilled into the pages of its first request's slot; the others fork: they share its (or the cache
    entry's) full pages and copy its partly filled last page; each samples its first token from the prompt's
    last logits with its own key. New prompts enter the prefix cache. `admissible` must have said the pages
    are there; the slots must be free."""
    n, num_slots, ec = len(prefix.prompts), self.config.num_slots, self.config
    if len(slots) != n or len(set(slots)) != n or any(not 0 <= s < num_slots for s in slots):
      raise ValueError(f"insert takes {n} distinct slots in 0..{num_slots - 1}, got {list(slots)}")
    versions = {key[1] for key in prefix.keys if key is not None}
    if versions:  # entries of older weights can never be used again
      stale = tuple(e for e in state.cache if e[0][1] < max(versions))
      for entry in stale:
        state = dataclasses.replace(state, pages=self._release(state.pages, entry[1]))
      state = dataclasses.replace(state, cache=tuple(e for e in state.cache if e not in stale))
    cached = {key: row for key, row in state.cache}
    needed = sum(self._needs(state, prefix.prompts, prefix.keys))
    state = self._evict(state, needed, keep={k for k in prefix.keys if k in cached})
    cached = {key: row for key, row in state.cache}
    rows = prefix.arrays[0].shape[0]
    # Distinct prompts to prefill (a resumed request, or with sharing off every request, is its own).
    fresh, source = {}, []  # key -> fresh row; per request: ("fresh", u) or ("cache", entry)
    for i, key in enumerate(prefix.keys):
      if key is not None and key in cached:
        source.append(("cache", cached[key]))
      else:
        source.append(("fresh", fresh.setdefault(key if key is not None else ("own", i), len(fresh))))
    u_rows = next(r for r in ec.row_buckets if r >= max(1, len(fresh)))
    tokens, lengths = np.zeros((u_rows, prefix.bucket), np.int32), np.ones((u_rows,), np.int32)
    for i, (kind, u) in enumerate(source):
      if kind == "fresh":
        tokens[u, :len(prefix.prompts[i])], lengths[u] = prefix.prompts[i], len(prefix.prompts[i])
    # Pages, on the host: the first request of a fresh prompt reserves and writes; the rest fork.
    pages, holder = state.pages, {}  # fresh row -> the slot that writes it
    plan = InsertPlan(rows, num_slots + self.cache_rows)
    for i, (slot, (kind, u)) in enumerate(zip(slots, source)):
      length = len(prefix.prompts[i])
      plan.slots[i], plan.lengths[i] = slot, length
      plan.logit_row[i] = u if kind == "fresh" else u_rows + (u - num_slots)
      if kind == "fresh" and u not in holder:
        pages, ok = self._reserve(pages, slot, length, self.page_size)
        pages = self._advance(pages, one_hot(pages.length.shape[0], slot, length))
        holder[u], plan.writer[i], plan.write_row[i] = slot, True, u
      else:
        pages, ok, plan.copy_from[i], plan.copy_to[i] = self._fork(pages, holder[u] if kind == "fresh" else u, slot,
                                                                   self.page_size)
      if not bool(ok):
        raise RuntimeError(f"the page pool ran out inserting into slot {slot}; `admissible` should have held it back")
    resumed_rows = {u for i, (kind, u) in enumerate(source) if kind == "fresh" and prefix.resume[i]}
    self.counters["prefill_tokens"] += int(sum(lengths[u] for u in range(len(fresh)) if u not in resumed_rows))
    self.counters["resume_prefill_tokens"] += int(sum(lengths[u] for u in resumed_rows))
    self.counters["prompts_shared"] += sum(1 for kind, _ in source if kind == "fresh") - len(fresh)
    self.counters["prefix_cache_hits"] += sum(1 for kind, _ in source if kind == "cache")
    cache = [e for e in state.cache]
    for key, u in fresh.items():  # a new entry forks the writer's row; the oldest goes when the cache is full
      if key[0] == "own" or not self.cache_rows:
        continue
      used = {row for _, row in cache}
      if len(cache) == self.cache_rows:
        pages = self._release(pages, cache.pop(0)[1])
        used = {row for _, row in cache}
      row = next(r for r in range(num_slots, num_slots + self.cache_rows) if r not in used)
      pages, ok, plan.cache_copy_from[u], plan.cache_copy_to[u] = self._fork(pages, holder[u], row, self.page_size)
      if bool(ok):
        cache.append((key, row))
        plan.cache_entry[u] = row - num_slots
    hits = [e for e in cache if e[0] in {k for k in prefix.keys}]
    cache = [e for e in cache if e not in hits] + hits  # most recently used last
    given, generated = np.full((rows,), -1, np.int32), np.ones((rows,), np.int32)
    for i, resume in enumerate(prefix.resume):
      if resume:
        given[i], generated[i] = resume
    new_rows, prefix.firsts = self._insert(prefix.params, state.rows, tokens, lengths, plan.arrays(np.asarray(pages.table)),
                                           prefix.arrays, given, generated)
    return PagedState(new_rows, pages, tuple(cache))

  def _insert_impl(self, params, rows: PagedRows, tokens, lengths, plan: dict, arrays: tuple, given, generated):
    """Prefills the fresh prompts (tokens [U, bucket]) into a scratch cache, writes them into the writers'
    pages, copies the forks' and new cache entries' partly filled pages, samples every request's first token
    from its prompt's last logits (fresh, or a cache entry's) and sets its slot's fields."""
    model = nnx.merge(self.graphdef, params)
    u_rows, bucket = tokens.shape
    mask = jnp.arange(bucket)[None, :] < lengths[:, None]
    logits, scratch = model.forward_with_cache(tokens, KVCache.init(self.model_config, u_rows, bucket), mask,
                                               logits_at=lengths - 1)
    rng, temperature, top_k, top_p, max_new, stop_ids = arrays
    write = plan["writer"][:, None] & (jnp.arange(bucket)[None, :] < plan["lengths"][:, None])
    pool, src = rows.pool, plan["write_row"]
    keys, values = [], []
    for k_pages, v_pages, k, v in zip(pool.keys, pool.values, scratch.keys, scratch.values):
      k_pages, v_pages = write_layer(k_pages, v_pages, plan["table"], jnp.zeros_like(plan["lengths"]),
                                     k[src].transpose(0, 2, 1, 3), v[src].transpose(0, 2, 1, 3), write)
      keys.append(k_pages)
      values.append(v_pages)
    pool = pool.replace(keys=tuple(keys), values=tuple(values))
    pool = copy_pages(pool, plan["copy_from"], plan["copy_to"])  # after the writes: forks copy written pages
    pool = copy_pages(pool, plan["cache_copy_from"], plan["cache_copy_to"])
    all_logits = jnp.concatenate([logits[:, 0], rows.prefix_logits], axis=0)
    token, logprob, done = first_tokens(all_logits[plan["logit_row"]], rng, temperature, top_k, top_p, max_new,
                                        stop_ids)
    resumed = given >= 0
    token, done = jnp.where(resumed, given, token), done & ~resumed
    entry = plan["cache_entry"][:u_rows]  # fresh row -> the cache entry it fills (out of range: none)
    prefix_logits = rows.prefix_logits.at[entry].set(logits[:, 0], mode="drop")
    slots = plan["slots"]
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    rows = rows.replace(
        pool=pool, prefix_logits=prefix_logits, length=put(rows.length, plan["lengths"]), last_token=put(rows.last_token, token),
        rng=put(rows.rng, rng), generated=put(rows.generated, generated), active=put(rows.active, ~done),
        temperature=put(rows.temperature, temperature), top_k=put(rows.top_k, top_k), top_p=put(rows.top_p, top_p),
        max_new=put(rows.max_new, max_new), stop_ids=put(rows.stop_ids, stop_ids))
    return rows, FirstTokens(first_token=token, first_logprob=jnp.where(resumed, 0.0, logprob), done=done)


  def generate(self, params, state: PagedState, window: int | None = None) -> tuple[PagedState, StepOutput]:
    """`steps_per_sync` decode steps for the rows that hold pages, gathered into the smallest power-of-two
    batch that holds them (a row is its table and a few scalars: no keys or values move), so a step costs the
    busy rows, not every slot. `make_room` must have reserved their pages. `window`, one of
    `config.attention_windows`, must exceed every active row's last write."""
    window = self.config.cache_length if window is None else window
    if window not in self.config.attention_windows:
      raise ValueError(f"window {window} is not one of {self.config.attention_windows}")
    table = np.asarray(state.pages.table)[:self.config.num_slots]
    busy = table[:, 0] >= 0
    idx = np.flatnonzero(busy)
    batch = 1 << max(0, len(idx) - 1).bit_length()
    idx = np.concatenate([idx, np.flatnonzero(~busy)[:batch - len(idx)]]).astype(np.int32)  # free rows pad
    rows, out = self._generate(params, state.rows, table[idx], idx, window)
    grown = np.zeros((state.pages.length.shape[0],), np.int32)
    grown[:len(busy)] = busy * self.config.steps_per_sync
    return PagedState(rows, self._advance(state.pages, grown), state.cache), out

  def _generate_impl(self, params, rows: PagedRows, table, idx, window: int):
    model = nnx.merge(self.graphdef, params)
    table = table[:, :window // self.page_size]
    fields = [f.name for f in dataclasses.fields(PagedRows) if f.name not in ("pool", "prefix_logits")]
    sub = rows.replace(**{name: getattr(rows, name)[idx] for name in fields})

    def step(sub: PagedRows, _):
      active = sub.active
      logits, pool = model.forward_paged(sub.last_token[:, None], sub.pool, table, sub.length, active[:, None],
                                         window)
      changes, out = sample_next(sub, logits)
      return sub.replace(pool=pool, length=sub.length + active, **changes), out

    sub, out = jax.lax.scan(step, sub, None, length=self.config.steps_per_sync)
    rows = rows.replace(pool=sub.pool, **{name: getattr(rows, name).at[idx].set(getattr(sub, name)) for name in fields})
    spread = lambda x: jnp.zeros(x.shape[:1] + (self.config.num_slots,), x.dtype).at[:, idx].set(x)  # noqa: E731
    return rows, jax.tree.map(spread, out)
