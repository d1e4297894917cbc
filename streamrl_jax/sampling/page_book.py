"""The paged engine's host half: who holds which page (a `paged_cache.PageState` on the CPU), the prefix cache of
prompts kept for later calls, and the page decisions of each call: admission by free pages, room for the next
tokens (preempting the least advanced row when the pool runs out), the page operations of an insert, and rows
parked off their slots.

Page-state rows: 0..S-1 are the slots, S..S+C-1 the prefix-cache entries, S+C..2S+C-1 the parked rows. Every
change goes through the pure functions of `paged_cache`, jitted on one host CPU device, so the host always
knows what is free and the device gets each call's page tables as an argument.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from streamrl_jax.counters import Counters
from streamrl_jax.models.paged_cache import (PageState, advance, fork, move_rows, pages_for, release, release_before,
                                             reserve, reserve_rows, set_lengths)
from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.sampling.paged_prefill import InsertPlan, PagedPrefix, one_hot


@dataclasses.dataclass(frozen=True)
class PagedState:
  """A paged engine instance's state: the device rows (`paged_engine.PagedRows`) and, on the host, the page
  bookkeeping, the prefix cache's keys in use order, and the rows the last `make_room` reserved for."""

  rows: object
  pages: PageState  # on the CPU: reference counts, tables, lengths (an upper bound while a call runs)
  cache: tuple = ()  # ((prompt tokens, version), cache row), least recently used first
  decoding: tuple | None = None  # slots the next `generate` decodes (None: every slot holding pages)


@dataclasses.dataclass(slots=True, eq=False)
class PageCounters(Counters):
  """The page book's prefills, prompts shared, prefix-cache hits, rows preempted, entries evicted, pages freed behind
  a sliding window."""

  prefill_tokens: int = 0  # prompts prefilled
  resume_prefill_tokens: int = 0  # preempted requests' prompt and tokens, prefilled again
  prompts_shared: int = 0
  prefix_cache_hits: int = 0
  preempted: int = 0
  evicted: int = 0
  window_freed: int = 0  # pages given back once every layer's sliding window had passed them


class PageBook:
  """Page decisions of one paged engine over `num_pages` pages of `config.page_size` tokens."""

  def __init__(self, config: EngineConfig, num_pages: int, cache_rows: int, window: int = 0):
    """`window`: a model whose every layer slides over this many positions (0: not such a model) gives back the
    pages its rows have left behind."""
    self.config, self.num_pages, self.cache_rows, self.window = config, num_pages, cache_rows, window
    self.page_size, self.slots = config.page_size, config.num_slots
    self.pages_per_row = config.cache_length // config.page_size
    self._cpu = jax.devices("cpu")[0]
    self._reserve = jax.jit(reserve, static_argnums=(3,))
    self._reserve_rows = jax.jit(reserve_rows, static_argnums=(3,))
    self._fork = jax.jit(fork, static_argnums=(3,))
    self._release = jax.jit(release)
    self._release_before = jax.jit(release_before)
    self._advance = jax.jit(advance)
    self._move_rows = jax.jit(move_rows)
    self._set_lengths = jax.jit(set_lengths)
    self.counters = PageCounters()

  def init(self) -> PageState:
    return jax.device_put(PageState.init(self.num_pages, 2 * self.slots + self.cache_rows, self.pages_per_row),
                          self._cpu)

  def parking_row(self, place: int) -> int:
    return self.slots + self.cache_rows + place

  # ---- the prefix cache ---------------------------------------------------------------------------
  def free_pages(self, state: PagedState) -> int:
    return int(np.count_nonzero(np.asarray(state.pages.refcount) == 0))

  def evictable_pages(self, state: PagedState, keep=()) -> int:
    """Pages that only prefix-cache entries (but those of `keep`) hold: what evicting them would free."""
    refcount, table = np.asarray(state.pages.refcount), np.asarray(state.pages.table)
    held = collections.Counter(int(p) for key, row in state.cache if key not in keep for p in table[row] if p >= 0)
    return sum(1 for page, n in held.items() if refcount[page] == n)

  def evict(self, state: PagedState, wanted_free: int, keep=()) -> PagedState:
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
      self.counters.evicted += 1
    return dataclasses.replace(state, pages=pages, cache=tuple(cache))

  def drop_entries(self, state: PagedState, entries) -> PagedState:
    """The given prefix-cache entries' pages go back to the pool."""
    pages = state.pages
    for _, row in entries:
      pages = self._release(pages, row)
    return dataclasses.replace(state, pages=pages, cache=tuple(e for e in state.cache if e not in entries))

  def keys(self, prompts, resumed, version) -> list:
    """Each request's prefix-cache key (prompt tokens, weight version); None when it is not shared."""
    return [(tuple(np.asarray(p).tolist()), version) if not extra and self.config.share_prompts else None
            for p, extra in zip(prompts, resumed)]

  def needs(self, state: PagedState, prompts: Sequence, keys: Sequence) -> list[int]:
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

  # ---- admission and growth -----------------------------------------------------------------------
  def admissible(self, state: PagedState, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int:
    """How many of `prompts` (one prefill call's, in order) can start: after the busy rows' next
    `steps_per_sync` tokens, pages must remain (free, or held only by the prefix cache) for each one's prompt
    and first tokens (`needs`). A run of one prompt's requests is not cut unless it starts the call."""
    chunk = self.config.steps_per_sync
    length, held = np.asarray(state.pages.length)[:self.slots], np.asarray(state.pages.pages_held())[:self.slots]
    growth = int(np.maximum(pages_for(self._grown(length, chunk), self.page_size) - held, 0)[held > 0].sum())
    keys = self.keys(prompts, resumed, version)
    free = self.free_pages(state) + self.evictable_pages(state, keep=set(keys)) - growth
    for i, need in enumerate(self.needs(state, prompts, keys)):
      if need > free:
        run = i  # do not cut a run of one prompt's requests (a group shares one prefill) unless it is the first
        while run > 0 and keys[i] is not None and keys[run - 1] == keys[i]:
          run -= 1
        return run or i
      free -= need
    return len(prompts)

  def make_room(self, state: PagedState, progress: dict[int, int], deactivate) -> tuple[PagedState, list[int]]:
    """Reserves pages for every slot of `progress` for its next `steps_per_sync` tokens. While the pool cannot
    hold them, prefix-cache entries go first, then the slot with the least progress (`progress[slot]` tokens;
    ties: the highest slot) is preempted: its pages go back and `deactivate(rows, slot)` stops its row.
    Returns (state, the preempted slots); the slots kept are the ones the next `generate` decodes."""
    slots, preempted = sorted(progress), []
    if self.window:
      state = self._behind_window(state, slots)
    while slots:
      need = self._grown(np.asarray(state.pages.length)[slots], self.config.steps_per_sync)
      pages, ok = self._reserve_rows(state.pages, np.asarray(slots, np.int32), need.astype(np.int32), self.page_size)
      state = dataclasses.replace(state, pages=pages)
      if np.asarray(ok).all():
        break
      if state.cache:  # cached prefixes go before any row: until one more page is free
        state = self.evict(state, self.free_pages(state) + 1)
        continue
      victim = min(slots, key=lambda s: (progress[s], -s))
      slots.remove(victim)
      preempted.append(victim)
      state = dataclasses.replace(state, rows=deactivate(state.rows, victim),
                                  pages=self._release(state.pages, victim))
      self.counters.preempted += 1
    return dataclasses.replace(state, decoding=tuple(slots)), preempted

  def _behind_window(self, state: PagedState, slots: list[int]) -> PagedState:
    """Each row's pages whose tokens lie behind every query it can still make (a query at position p sees p -
    window + 1 on): given back. A row's length is taken a call's steps lower than the book's (an upper bound)."""
    length = np.asarray(state.pages.length)
    pages = state.pages
    for slot in slots:
      behind = max(0, int(length[slot]) - self.config.steps_per_sync - self.window + 1) // self.page_size
      if behind:
        pages = self._release_before(pages, slot, behind)
    self.counters.window_freed += int(np.count_nonzero(np.asarray(pages.refcount) == 0)) - self.free_pages(state)
    return dataclasses.replace(state, pages=pages)

  def _grown(self, length: np.ndarray, steps: int) -> np.ndarray:
    """Rows' lengths after `steps` more tokens, at most the cache's length: a row ends there, so it never needs
    more pages (a length is an upper bound, and calls shorter than `steps_per_sync` shift where rows stand)."""
    return np.minimum(length + steps, self.config.cache_length)

  def decoded(self, state: PagedState, busy: np.ndarray, steps: int) -> PagedState:
    """After a decode call of `steps` steps: the `busy` slots grew by `steps` tokens (an upper bound)."""
    grown = np.zeros((state.pages.length.shape[0],), np.int32)
    grown[:len(busy)] = busy * steps
    return dataclasses.replace(state, pages=self._advance(state.pages, grown), decoding=None)

  def extend_room(self, state: PagedState, exact: dict[int, int], extra: dict[int, int]) -> tuple[PagedState, list]:
    """Pages for `extra[slot]` more tokens after each paused row's `exact[slot]` tokens (its length, which the
    host knew only as a bound); cached prefixes are evicted before a row is refused. Returns (state, the
    slots refused: the pool cannot hold them)."""
    slots = sorted(extra)
    pages = self._set_lengths(state.pages, np.asarray(slots, np.int32), np.asarray([exact[s] for s in slots], np.int32))
    state, refused = dataclasses.replace(state, pages=pages), []
    for slot in slots:
      while True:
        pages, ok = self._reserve(state.pages, slot, exact[slot] + extra[slot], self.page_size)
        if bool(ok) or not state.cache:
          break
        state = self.evict(state, self.free_pages(state) + 1)
      if bool(ok):
        state = dataclasses.replace(state, pages=self._advance(pages, one_hot(pages.length.shape[0], slot,
                                                                               extra[slot])))
      else:
        refused.append(slot)
    return state, refused

  def release(self, state: PagedState, row: int) -> PagedState:
    return dataclasses.replace(state, pages=self._release(state.pages, row))

  def move(self, state: PagedState, src: Sequence[int], dst: Sequence[int]) -> PagedState:
    """Rows' pages move from rows `src` to rows `dst` (parking and unparking)."""
    return dataclasses.replace(state, pages=self._move_rows(state.pages, np.asarray(src, np.int32),
                                                            np.asarray(dst, np.int32)))

  # ---- an insert's page operations ------------------------------------------------------------------
  def plan_insert(self, state: PagedState, prefix: PagedPrefix, slots: Sequence[int]):
    """The page operations of inserting `prefix`'s requests into `slots`: stale and evicted cache entries
    dropped, each distinct prompt reserved by its first request and forked by the rest (or forked from a
    cache entry), new prompts entered into the cache. Returns (state, plan, tokens [U, bucket] and lengths
    [U] of the prompts to prefill)."""
    versions = {key[1] for key in prefix.keys if key is not None}
    if versions:  # entries of older weights can never be used again
      state = self.drop_entries(state, tuple(e for e in state.cache if e[0][1] < max(versions)))
    cached = {key: row for key, row in state.cache}
    state = self.evict(state, sum(self.needs(state, prefix.prompts, prefix.keys)),
                       keep={k for k in prefix.keys if k in cached})
    fresh, source = self._sources(prefix, {key: row for key, row in state.cache})
    u_rows = self.config.row_bucket_for(len(fresh))
    tokens, lengths = np.zeros((u_rows, prefix.bucket), np.int32), np.ones((u_rows,), np.int32)
    for i, (kind, u) in enumerate(source):
      if kind == "fresh":
        tokens[u, :len(prefix.prompts[i])], lengths[u] = prefix.prompts[i], len(prefix.prompts[i])
    plan = InsertPlan(prefix.arrays.rng.shape[0], self.slots + self.cache_rows)
    pages, holder = self._place(state.pages, prefix, slots, source, u_rows, plan)
    self._count(prefix, source, fresh, lengths)
    pages, cache = self._cache_new(pages, list(state.cache), fresh, holder, plan)
    hits = [e for e in cache if e[0] in set(prefix.keys)]
    cache = [e for e in cache if e not in hits] + hits  # most recently used last
    return PagedState(state.rows, pages, tuple(cache)), plan, tokens, lengths

  @staticmethod
  def _sources(prefix: PagedPrefix, cached: dict):
    """Distinct prompts to prefill (a resumed request, or with sharing off every request, is its own): the
    fresh prompts' rows by key, and per request ("fresh", its row) or ("cache", the entry's page row)."""
    fresh, source = {}, []
    for i, key in enumerate(prefix.keys):
      if key is not None and key in cached:
        source.append(("cache", cached[key]))
      else:
        source.append(("fresh", fresh.setdefault(key if key is not None else ("own", i), len(fresh))))
    return fresh, source

  def _place(self, pages, prefix: PagedPrefix, slots, source, u_rows: int, plan: InsertPlan):
    """The first request of a fresh prompt reserves and writes its pages; the rest fork. Returns (pages,
    fresh row -> the slot that writes it)."""
    holder = {}
    for i, (slot, (kind, u)) in enumerate(zip(slots, source)):
      length = len(prefix.prompts[i])
      plan.slots[i], plan.lengths[i] = slot, length
      plan.logit_row[i] = u if kind == "fresh" else u_rows + (u - self.slots)
      if kind == "fresh" and u not in holder:
        pages, ok = self._reserve(pages, slot, length, self.page_size)
        pages = self._advance(pages, one_hot(pages.length.shape[0], slot, length))
        holder[u], plan.writer[i], plan.write_row[i] = slot, True, u
      else:
        pages, ok, plan.copy_from[i], plan.copy_to[i] = self._fork(pages, holder[u] if kind == "fresh" else u, slot,
                                                                   self.page_size)
      if not bool(ok):
        raise RuntimeError(f"the page pool ran out inserting into slot {slot}; `admissible` should have held it back")
    return pages, holder

  def _count(self, prefix: PagedPrefix, source, fresh: dict, lengths) -> None:
    resumed_rows = {u for i, (kind, u) in enumerate(source) if kind == "fresh" and prefix.resume[i]}
    self.counters.prefill_tokens += int(sum(lengths[u] for u in range(len(fresh)) if u not in resumed_rows))
    self.counters.resume_prefill_tokens += int(sum(lengths[u] for u in resumed_rows))
    self.counters.prompts_shared += sum(1 for kind, _ in source if kind == "fresh") - len(fresh)
    self.counters.prefix_cache_hits += sum(1 for kind, _ in source if kind == "cache")

  def _cache_new(self, pages, cache: list, fresh: dict, holder: dict, plan: InsertPlan):
    """A new prompt's entry forks its writer's row; the oldest entry goes when the cache is full."""
    for key, u in fresh.items():
      if key[0] == "own" or not self.cache_rows:
        continue
      if len(cache) == self.cache_rows:
        pages = self._release(pages, cache.pop(0)[1])
      used = {row for _, row in cache}
      row = next(r for r in range(self.slots, self.slots + self.cache_rows) if r not in used)
      pages, ok, plan.cache_copy_from[u], plan.cache_copy_to[u] = self._fork(pages, holder[u], row, self.page_size)
      if bool(ok):
        cache.append((key, row))
        plan.cache_entry[u] = row - self.slots
    return pages, cache
