"""The paged decode engine: rows keep their keys and values in fixed-size pages of one pool, taken as they
grow, so memory follows the tokens generated rather than `max_prompt_length + max_new_tokens` per slot.

- Pages are bookkept on the host by a `page_book.PageBook` (reference counts, each row's page table, its
  length, the prefix cache), changed only by the pure functions of `paged_cache`, jitted on the CPU. The host
  therefore knows exactly what is free; the device gets each call's page tables as an argument.
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
- Multi-turn rows: `extend` appends a tool's tokens to a paused row by a prefill of just those tokens over its
  pages (`extend_room` first reserves them, or refuses the row, which the driver then resumes later); `park`
  moves a paused row off its slot, which moves only its page-table row and a few scalars: its keys and values
  stay in their pages.

The pool's heads are split over "tensor"; rows are not split over "data" (more engine instances are the
data-parallel form). Compiles: prefill and insert one each per (distinct-prompt row bucket, request row
bucket, length bucket), generate one per (busy-row bucket: a power of two up to num_slots, attention window).
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

from streamrl_jax.models import KVCache, ModelConfig, logical_spec
from streamrl_jax.models.fused_attention import decode_kernel
from streamrl_jax.models.layers import cache_dtype
from streamrl_jax.models.paged_cache import NO_PAGE, PagePool, check_prompt_fits, copy_pages, write_layer
from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.sampling.engine_base import (EngineBase, PlannedCall, StepOutput, device_memory_budget, first_tokens,
                                               planned_requests, sample_next, shapes_of)
from streamrl_jax.sampling.page_book import PageBook, PagedState
from streamrl_jax.sampling.paged_prefill import FirstTokens, PagedPrefix
from streamrl_jax.types import SamplingParams

__all__ = ["PagedDecodeEngine", "PagedRows", "PagedState"]


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
  min_p: jax.Array
  max_new: jax.Array
  stop_ids: jax.Array  # [S, max_stop_tokens]
  prefix_logits: jax.Array  # [C, vocab] float32: the last prompt token's logits of cache entry c


ROW_FIELDS = tuple(f.name for f in dataclasses.fields(PagedRows) if f.name not in ("pool", "prefix_logits"))


class PagedDecodeEngine(EngineBase):
  """An `Engine` over a page pool for a `Transformer` on one mesh. Params are the model's `nnx.State`."""

  def __init__(self, graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
    super().__init__(graphdef, model_config, config, mesh, rules)
    self.page_size = config.page_size
    self.pages_per_row = config.cache_length // config.page_size
    self.num_pages = config.kv_pages or config.num_slots * self.pages_per_row
    self.cache_rows = config.prefix_cache_rows if config.share_prompts else 0
    if self.num_pages < self.pages_per_row:
      raise ValueError(f"EngineConfig.kv_pages={self.num_pages} holds {self.num_pages * self.page_size} tokens, "
                       f"fewer than one row at full length ({config.cache_length}); raise kv_pages")
    self.memory = pool_memory(self)
    self.book = PageBook(config, self.num_pages, self.cache_rows, _every_layer_window(model_config))
    self.counters = self.book.counters
    replicated = NamedSharding(mesh, PartitionSpec())
    self._shardings = self._state_shardings()
    jit = self.launcher.jit
    self._insert = jit(self._insert_impl, donate_argnums=(1,), out_shardings=(self._shardings, replicated))
    self._generate = jit(self._generate_impl, static_argnums=(4, 5), donate_argnums=(1,),
                         out_shardings=(self._shardings, replicated))
    self._extend = jit(self._extend_impl, donate_argnums=(1,), out_shardings=(self._shardings, replicated))
    self._park = jit(_park_impl, donate_argnums=(1,), out_shardings=replicated)
    self._unpark = jit(_unpark_impl, donate_argnums=(1,), out_shardings=self._shardings)
    self._deactivate = jit(lambda rows, slot: rows.replace(active=rows.active.at[slot].set(False)),
                           donate_argnums=(0,), out_shardings=self._shardings)
    self._init_rows = jit(self._empty_rows, out_shardings=self._shardings)  # once: a new jit traces anew
    self._init_parking = jit(lambda: {name: getattr(self._empty_rows(), name) for name in ROW_FIELDS})

  # ---- memory -----------------------------------------------------------------------------------
  def _state_shardings(self):
    abstract = jax.eval_shape(self._empty_rows)

    def spec(x):
      names = ("kv_heads", None, None, "head_dim") if x.ndim == 4 else (None,) * x.ndim
      return NamedSharding(self.mesh, logical_spec(names, x.shape, self.mesh, self.rules))
    return jax.tree.map(spec, abstract)

  def _check_prompt_fits(self, prompt_length: int) -> None:
    check_prompt_fits(prompt_length, self.num_pages, self.page_size)

  # ---- state ------------------------------------------------------------------------------------
  def _empty_rows(self) -> PagedRows:
    s, ec = self.config.num_slots, self.config
    return PagedRows(
        pool=PagePool.init(self.model_config, self.num_pages, self.page_size,
                           kernel=decode_kernel(ec.attention, self.mesh)), length=jnp.zeros((s,), jnp.int32),
        last_token=jnp.zeros((s,), jnp.int32), rng=jnp.zeros((s, 2), jnp.uint32), generated=jnp.zeros((s,), jnp.int32),
        active=jnp.zeros((s,), bool), temperature=jnp.ones((s,), jnp.float32), top_k=jnp.zeros((s,), jnp.int32),
        top_p=jnp.ones((s,), jnp.float32), min_p=jnp.zeros((s,), jnp.float32), max_new=jnp.ones((s,), jnp.int32),
        stop_ids=jnp.full((s, ec.max_stop_tokens), -1, jnp.int32),
        prefix_logits=jnp.zeros((max(1, self.cache_rows), self.model_config.vocab_size), jnp.float32))

  def init_decode_state(self) -> PagedState:
    return PagedState(self._init_rows(), self.book.init())

  def planned_calls(self, params) -> tuple[dict[str, PlannedCall], PagedRows]:
    """(the insert (`prefill`: a call of `prefill_batch` distinct prompts of the longest bucket, prefilled into their
    pages) and `decode` (one step of every slot over the whole cache) lowered for a plan, the decode state's shapes);
    `params` are shapes placed by `place_params`."""
    ec = self.config
    rows = shapes_of(self._empty_rows, self._shardings)
    prompts, samplings, rngs = planned_requests(ec, self.model_config.vocab_size)
    prefix = self.prefill(params, prompts, samplings=samplings, rngs=rngs)
    state, plan, tokens, lengths = self.book.plan_insert(PagedState(rows, self.book.init()), prefix,
                                                         list(range(ec.prefill_batch)))
    table, slots = np.zeros((ec.num_slots, self.pages_per_row), np.int32), np.arange(ec.num_slots, dtype=np.int32)
    return {"prefill": PlannedCall(self._insert.trace(params, rows, tokens, lengths, plan.arrays(
                np.asarray(state.pages.table)), prefix.arrays).lower(), reads_state=True),
            "decode": PlannedCall(self._generate.trace(params, rows, table, slots, ec.cache_length, 1).lower(),
                                  True)}, rows

  def free_pages(self, state: PagedState) -> int:
    return self.book.free_pages(state)

  def drop_prefix_cache(self, state: PagedState) -> PagedState:
    """Every prefix-cache entry's pages go back to the pool."""
    return self.book.drop_entries(state, state.cache)

  # ---- memory as rows grow ------------------------------------------------------------------------
  def admissible(self, state: PagedState, prompts: Sequence, resumed: Sequence[int], version: int = 0) -> int:
    """How many of `prompts` (in order) have the pages to start (`PageBook.admissible`)."""
    return self.book.admissible(state, prompts, resumed, version)

  def make_room(self, state: PagedState, progress: dict[int, int]) -> tuple[PagedState, list[int]]:
    """Reserves pages for the next `steps_per_sync` tokens of the slots of `progress` (the rows to decode),
    preempting the least advanced when the pool runs out (`PageBook.make_room`)."""
    return self.book.make_room(state, progress, self._deactivate)

  def extend_room(self, state: PagedState, rows: dict[int, int]) -> tuple[PagedState, list[int]]:
    """Pages for `rows[slot]` tokens appended to each paused row; returns (state, the slots the pool cannot
    hold, which the caller releases and resumes later)."""
    if not rows:
      return state, []
    length = np.asarray(jax.device_get(state.rows.length))  # exact: the device is idle between decode calls
    return self.book.extend_room(state, {s: int(length[s]) for s in rows}, rows)

  def release(self, state: PagedState, slot: int) -> PagedState:
    """A finished slot's pages go back to the pool (shared ones once their last holder is done)."""
    return self.book.release(state, slot)

  # ---- prefill / insert / generate --------------------------------------------------------------
  def prefill(self, params, prompts: Sequence, *, samplings: Sequence[SamplingParams], rngs: Sequence,
              resume: Sequence[tuple[int, int] | None] | None = None, version: int = 0) -> PagedPrefix:
    """Plans a call of up to `prefill_batch` requests (`rngs[i]`: request i's key data); `insert` prefills each
    distinct prompt the prefix cache does not hold for `version` once. `resume[i] = (last token, tokens
    generated)` continues a preempted request whose `prompts[i]` is its prompt + tokens so far but the last:
    that token is its next input, not sampled."""
    resume = list(resume) if resume is not None else [None] * len(prompts)
    if len(prompts) != len(samplings):
      raise ValueError(f"prefill takes one SamplingParams per prompt; got {len(prompts)} and {len(samplings)}")
    arrays = self.request_arrays(samplings, rngs, resume)
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    return PagedPrefix(prompts, self.book.keys(prompts, [bool(r) for r in resume], version), resume, arrays,
                       max(self.config.resume_bucket_for(len(p)) for p in prompts), params)

  def insert(self, prefix: PagedPrefix, state: PagedState, slots: Sequence[int]) -> PagedState:
    """Request i of `prefix` takes slot `slots[i]`. A prompt neither the cache nor an earlier request holds is
    prefilled into the pages of its first request's slot; the others fork: they share its (or the cache
    entry's) full pages and copy its partly filled last page; each samples its first token from the prompt's
    last logits with its own key. New prompts enter the prefix cache. `admissible` must have said the pages
    are there; the slots must be free."""
    n, num_slots = len(prefix.prompts), self.config.num_slots
    if len(slots) != n or len(set(slots)) != n or any(not 0 <= s < num_slots for s in slots):
      raise ValueError(f"insert takes {n} distinct slots in 0..{num_slots - 1}, got {list(slots)}")
    state, plan, tokens, lengths = self.book.plan_insert(state, prefix, slots)
    rows, prefix.firsts = self._insert(prefix.params, state.rows, tokens, lengths,
                                       plan.arrays(np.asarray(state.pages.table)), prefix.arrays)
    return dataclasses.replace(state, rows=rows)

  def _insert_impl(self, params, rows: PagedRows, tokens, lengths, plan: dict, arrays):
    """Prefills the fresh prompts (tokens [U, bucket]) into a scratch cache, writes them into the writers'
    pages, copies the forks' and new cache entries' partly filled pages, samples every request's first token
    from its prompt's last logits (fresh, or a cache entry's) and sets its slot's fields."""
    model = nnx.merge(self.graphdef, params)
    u_rows, bucket = tokens.shape
    mask = jnp.arange(bucket)[None, :] < lengths[:, None]
    logits, scratch, *routes = model.forward_with_cache(tokens, KVCache.init(self.model_config, u_rows, bucket),
                                                        mask, logits_at=lengths - 1, with_routes=self.routed)
    write = plan["writer"][:, None] & (jnp.arange(bucket)[None, :] < plan["lengths"][:, None])
    pool, src, keys, values = rows.pool, plan["write_row"], [], []
    for k_pages, v_pages, k, v in zip(pool.keys, pool.values, scratch.keys, scratch.values):
      k_pages, v_pages = write_layer(k_pages, v_pages, plan["table"], jnp.zeros_like(plan["lengths"]),
                                     k[src].transpose(0, 2, 1, 3), v[src].transpose(0, 2, 1, 3), write)
      keys.append(k_pages)
      values.append(v_pages)
    pool = pool.replace(keys=tuple(keys), values=tuple(values))
    pool = copy_pages(pool, plan["copy_from"], plan["copy_to"])  # after the writes: forks copy written pages
    pool = copy_pages(pool, plan["cache_copy_from"], plan["cache_copy_to"])
    all_logits = jnp.concatenate([logits[:, 0], rows.prefix_logits], axis=0)
    token, logprob, done = first_tokens(all_logits[plan["logit_row"]], *arrays.knobs)
    resumed = arrays.given >= 0
    token, done = jnp.where(resumed, arrays.given, token), done & ~resumed
    entry = plan["cache_entry"][:u_rows]  # fresh row -> the cache entry it fills (out of range: none)
    put = lambda big, small: big.at[plan["slots"]].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    fields = dict(length=plan["lengths"], last_token=token, rng=arrays.rng, generated=arrays.generated, active=~done,
                  temperature=arrays.temperature, top_k=arrays.top_k, top_p=arrays.top_p, min_p=arrays.min_p,
                  max_new=arrays.max_new,
                  stop_ids=arrays.stop_ids)
    rows = rows.replace(pool=pool, prefix_logits=rows.prefix_logits.at[entry].set(logits[:, 0], mode="drop"),
                        **{name: put(getattr(rows, name), value) for name, value in fields.items()})
    return rows, FirstTokens(first_token=token, first_logprob=jnp.where(resumed, 0.0, logprob), done=done,
                             routes=_request_routes(routes[0], plan["logit_row"]) if routes else None)

  def generate(self, params, state: PagedState, window: int | None = None,
               steps: int | None = None) -> tuple[PagedState, StepOutput]:
    """`steps` decode steps (one of `config.step_options`; default `steps_per_sync`) for the rows the last
    `make_room` kept (without one: every row holding pages), gathered into the smallest power-of-two batch that
    holds them (a row is its table and a few scalars: no keys or values move), so a step costs the busy rows, not
    every slot. `window`, one of `config.attention_windows`, must exceed every active row's last write."""
    window, steps = self._window(window), self._steps(steps)
    table = np.asarray(state.pages.table)[:self.config.num_slots]
    busy = (table >= 0).any(axis=1)
    if state.decoding is not None:
      busy = np.isin(np.arange(self.config.num_slots), state.decoding)
    idx = np.flatnonzero(busy)
    batch = 1 << max(0, len(idx) - 1).bit_length()
    idx = np.concatenate([idx, np.flatnonzero(~busy)[:batch - len(idx)]]).astype(np.int32)  # idle rows pad
    rows, out = self._generate(params, state.rows, table[idx], idx, window, steps)
    return self.book.decoded(dataclasses.replace(state, rows=rows), busy, steps), out

  def _generate_impl(self, params, rows: PagedRows, table, idx, window: int, steps: int):
    model = nnx.merge(self.graphdef, params)
    table = table[:, :window // self.page_size]
    sub = rows.replace(**{name: getattr(rows, name)[idx] for name in ROW_FIELDS})

    def step(sub: PagedRows, _):
      active = sub.active
      logits, pool, *routes = model.forward_paged(sub.last_token[:, None], sub.pool, table, sub.length,
                                                  active[:, None], window, with_routes=self.routed)
      changes, out = sample_next(sub, logits)
      out = out.replace(routes=routes[0][:, 0] if routes else None)
      return sub.replace(pool=pool, length=sub.length + active, **changes), out

    sub, out = jax.lax.scan(step, sub, None, length=steps)
    rows = rows.replace(pool=sub.pool, **{name: getattr(rows, name).at[idx].set(getattr(sub, name))
                                          for name in ROW_FIELDS})
    spread = lambda x: jnp.zeros(x.shape[:1] + (self.config.num_slots,) + x.shape[2:], x.dtype).at[:, idx].set(x)  # noqa: E731
    return rows, jax.tree.map(spread, out)

  # ---- multi-turn rows ----------------------------------------------------------------------------
  def _extend_call(self, params, state: PagedState, targets, chunk, lengths):
    table = np.full((len(targets), self.pages_per_row), NO_PAGE, np.int32)  # padding rows write nothing
    real = targets < self.config.num_slots
    table[real] = np.asarray(state.pages.table)[targets[real]]
    rows, out = self._extend(params, state.rows, targets, table, chunk, lengths)
    return dataclasses.replace(state, rows=rows), out

  def _extend_impl(self, params, rows: PagedRows, targets, table, chunk, lengths):
    model = nnx.merge(self.graphdef, params)
    idx = jnp.minimum(targets, self.config.num_slots - 1)
    sub = rows.replace(**{name: getattr(rows, name)[idx] for name in ROW_FIELDS})
    mask = jnp.arange(chunk.shape[1])[None, :] < lengths[:, None]
    logits, pool, *routes = model.forward_paged(chunk, rows.pool, table, sub.length, mask,
                                                logits_at=jnp.maximum(lengths - 1, 0), with_routes=self.routed)
    # The first appended token (the stop token) was counted when it was sampled; the tool's tokens count now.
    sub = sub.replace(length=sub.length + lengths, active=lengths > 0,
                      generated=sub.generated + jnp.maximum(lengths - 1, 0))
    changes, out = sample_next(sub, logits)
    sub = sub.replace(**changes)
    rows = rows.replace(pool=pool, **{name: getattr(rows, name).at[targets].set(getattr(sub, name), mode="drop")
                                      for name in ROW_FIELDS})
    return rows, (out.tokens, out.logprobs, out.done, *routes)

  def init_parking(self) -> dict:
    """Room for `num_slots` rows parked off their slots: their decode fields (their pages stay where they are)."""
    return self._init_parking()

  def park(self, state: PagedState, parking: dict, slots: Sequence[int], places: Sequence[int]):
    """Moves the paused rows of `slots` to `places` of `parking`: their page-table rows to the book's parking
    rows, their fields to `parking`; the slots are then free. Returns (state, parking)."""
    for a, b in self.row_calls(slots, places):
      parking = self._park(state.rows, parking, a, b)
    state = self.book.move(state, list(slots), [self.book.parking_row(p) for p in places])
    return state, parking

  def unpark(self, state: PagedState, parking: dict, places: Sequence[int], slots: Sequence[int]):
    """Puts parked rows back from `places` into `slots`, inactive until `extend` goes on from them; returns
    (state, parking)."""
    rows = state.rows
    for a, b in self.row_calls(places, slots):
      rows = self._unpark(parking, rows, a, b)
    state = self.book.move(dataclasses.replace(state, rows=rows), [self.book.parking_row(p) for p in places],
                           list(slots))
    return state, parking

  def drop_parked(self, state: PagedState, parking: dict, place: int):
    """A parked row whose episode ended gives its pages back; returns (state, parking)."""
    return self.book.release(state, self.book.parking_row(place)), parking


def page_bytes(engine: PagedDecodeEngine) -> int:
  """Bytes of one page across every layer: its keys and values."""
  mc = engine.model_config
  itemsize = jnp.dtype(cache_dtype(mc.compute_dtype)).itemsize
  return 2 * mc.num_layers * mc.num_kv_heads * engine.page_size * mc.head_dim * itemsize


def pool_memory(engine: PagedDecodeEngine) -> dict:
  """The engine's weights and page pool per device, checked against its budget (raises naming the key to lower)."""
  tensor = engine.mesh.shape.get("tensor", 1)
  page = page_bytes(engine)
  param_bytes, kv_bytes = engine.param_bytes(), engine.num_pages * page
  per_device = (param_bytes + kv_bytes) / tensor
  budget = engine.config.memory_budget_bytes or device_memory_budget(engine.mesh.devices.flat[0])
  if per_device > budget:
    raise ValueError(f"paged engine needs {per_device / 2**20:.1f} MiB per device ({param_bytes / 2**20:.1f} MiB of "
                     f"parameters, {engine.num_pages} pages x {page / 2**20:.3f} MiB, / tensor={tensor}) "
                     f"but the budget is {budget / 2**20:.1f} MiB; lower EngineConfig.kv_pages")
  return dict(param_bytes=param_bytes, kv_bytes=kv_bytes, kv_pages=engine.num_pages, page_bytes=page,
              bytes_per_device=int(per_device), budget_bytes_per_device=int(budget))


def _request_routes(fresh, logit_row):
  """Each request's prompt's experts [R, bucket, sparse layers, k] from the call's fresh prompts' `fresh`, where this
  call prefilled it (`logit_row` below the fresh rows); -1 for a prompt the prefix cache held."""
  rows = fresh.shape[0]
  return jnp.where((logit_row < rows)[:, None, None, None], fresh[jnp.minimum(logit_row, rows - 1)], -1)


def _every_layer_window(model_config: ModelConfig) -> int:
  """The window of a model whose every layer slides (its pages behind every window go back to the pool), else 0."""
  windows = model_config.windows
  return 0 if None in windows else max(windows)


def _park_impl(rows: PagedRows, parking: dict, rows_from, rows_to) -> dict:
  return {name: parking[name].at[rows_to].set(getattr(rows, name)[rows_from], mode="drop") for name in ROW_FIELDS}


def _unpark_impl(parking: dict, rows: PagedRows, rows_from, rows_to) -> PagedRows:
  fields = {name: getattr(rows, name).at[rows_to].set(parking[name][rows_from], mode="drop") for name in ROW_FIELDS}
  fields["active"] = rows.active.at[rows_to].set(False, mode="drop")
  return rows.replace(**fields)
