"""Building blocks of a paged KV cache: page bookkeeping, a page pool, and attention over pages.

A pool holds `num_pages` fixed-size pages of keys and values per layer. Each row (a decode slot) owns a
table of page ids; token `pos` of a row lives at offset `pos % page_size` of page `table[row, pos //
page_size]`. Rows forked from one prompt share its full pages (counted by `refcount`) and copy only its
partly filled last page, so a group of G samples stores one prompt, not G.

Everything here is pure and jittable at static shapes: `f(state, inputs) -> (state, outputs)`. A call that
cannot be satisfied returns `ok=False` and leaves the state as it was; the caller decides what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.fused_attention import AttentionKernel, paged_decode_attention
from streamrl_jax.models.layers import attend_in, cache_dtype

NO_PAGE = -1  # table entry of a row slot that holds no page


def pages_for(num_tokens, page_size: int):
  """Pages needed to hold `num_tokens` tokens (python ints or arrays)."""
  return -(-num_tokens // page_size)


# ---- page bookkeeping ------------------------------------------------------------------------------
@flax.struct.dataclass
class PageState:
  """Who holds which page. A row's pages fill its table from the left; the rest of the table is -1 (and, for a model
  whose every layer slides, the slots of pages its window has passed: `release_before`)."""

  refcount: jax.Array  # [num_pages] int32: rows holding the page; 0 = free
  table: jax.Array  # [rows, pages_per_row] int32: page ids, NO_PAGE where none
  length: jax.Array  # [rows] int32: tokens the row holds

  @classmethod
  def init(cls, num_pages: int, rows: int, pages_per_row: int) -> PageState:
    return cls(refcount=jnp.zeros((num_pages,), jnp.int32),
               table=jnp.full((rows, pages_per_row), NO_PAGE, jnp.int32),
               length=jnp.zeros((rows,), jnp.int32))

  @property
  def num_pages(self) -> int:
    return self.refcount.shape[0]

  @property
  def rows(self) -> int:
    return self.table.shape[0]

  @property
  def pages_per_row(self) -> int:
    return self.table.shape[1]

  @property
  def free_pages(self) -> jax.Array:
    """Count of free pages (a jax scalar)."""
    return jnp.sum(self.refcount == 0, dtype=jnp.int32)

  def pages_held(self) -> jax.Array:
    """[rows] int32: the table slots each row's pages reach (its last page's slot + 1; a sliding window's pages
    given back from the row's start leave holes, which count)."""
    slots = jnp.arange(1, self.table.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(self.table >= 0, slots, 0), axis=1, initial=0)


def _add_refs(refcount: jax.Array, pages: jax.Array, take: jax.Array, delta: int) -> jax.Array:
  """refcount[pages] += delta where `take` (and the page exists); other entries are dropped."""
  idx = jnp.where(take & (pages >= 0), pages, refcount.shape[0])
  return refcount.at[idx].add(delta, mode="drop")


def reserve(state: PageState, row, num_tokens, page_size: int) -> tuple[PageState, jax.Array]:
  """Makes `row` able to hold `num_tokens` tokens in all, taking the lowest-id free pages it lacks.

  Returns (state, ok); ok is False, and the state unchanged, when the pool has too few free pages or the
  row would need more than `pages_per_row`. `length` is left alone: `advance` records written tokens.
  """
  m = state.pages_per_row
  have = state.pages_held()[row]
  need = pages_for(jnp.asarray(num_tokens, jnp.int32), page_size)
  extra = jnp.maximum(need - have, 0)
  ok = (need <= m) & (extra <= state.free_pages)
  free_ids = jnp.nonzero(state.refcount == 0, size=m, fill_value=NO_PAGE)[0]  # lowest ids first
  k = jnp.arange(m)
  refcount = _add_refs(state.refcount, free_ids, ok & (k < extra), 1)
  slot = k - have  # table slot j takes the (j - have)-th new page
  new = ok & (slot >= 0) & (slot < extra)
  row_table = jnp.where(new, free_ids[jnp.clip(slot, 0, m - 1)], state.table[row])
  return state.replace(refcount=refcount, table=state.table.at[row].set(row_table)), ok


def reserve_rows(state: PageState, rows: jax.Array, num_tokens: jax.Array,
                 page_size: int) -> tuple[PageState, jax.Array]:
  """`reserve` for each (rows[i], num_tokens[i]) in turn; ok [N]. num_tokens 0 is a no-op."""
  def body(s, args):
    return reserve(s, args[0], args[1], page_size)
  return jax.lax.scan(body, state, (jnp.asarray(rows, jnp.int32), jnp.asarray(num_tokens, jnp.int32)))


def advance(state: PageState, num_new: jax.Array) -> PageState:
  """Records `num_new` [rows] tokens written after each row's current length."""
  return state.replace(length=state.length + jnp.asarray(num_new, jnp.int32))


def fork(state: PageState, src, dst, page_size: int):
  """Row `dst` (empty) becomes a copy of row `src`: it shares src's full pages and takes a fresh page
  for src's partly filled last page, if any. Pages src reserved past its length are not shared.

  Returns (state, ok, copy_from, copy_to): the caller copies the KV content of page copy_from to page
  copy_to (both NO_PAGE when there is nothing to copy). ok is False, and the state unchanged, when dst
  is not empty or no page is free for the copy.
  """
  m, length = state.pages_per_row, state.length[src]
  full = length // page_size
  partial = (length % page_size) != 0
  fresh = jnp.argmax(state.refcount == 0).astype(jnp.int32)  # lowest free id (meaningful if any is free)
  dst_empty = (state.pages_held()[dst] == 0) & (state.length[dst] == 0)
  ok = dst_empty & (~partial | (state.free_pages > 0))
  k = jnp.arange(m)
  src_row = state.table[src]
  shared = ok & (k < full)
  refcount = _add_refs(state.refcount, src_row, shared, 1)
  copy = ok & partial
  refcount = _add_refs(refcount, fresh[None], copy[None], 1)
  dst_row = jnp.where(shared, src_row, jnp.where(copy & (k == full), fresh, NO_PAGE))
  table = state.table.at[dst].set(jnp.where(ok, dst_row, state.table[dst]))
  new_length = state.length.at[dst].set(jnp.where(ok, length, state.length[dst]))
  copy_from = jnp.where(copy, src_row[jnp.minimum(full, m - 1)], NO_PAGE)
  copy_to = jnp.where(copy, fresh, NO_PAGE)
  return state.replace(refcount=refcount, table=table, length=new_length), ok, copy_from, copy_to


def fork_many(state: PageState, src, dsts: jax.Array, page_size: int):
  """`fork(state, src, dst)` for each dst in `dsts` [N] in turn (a GRPO group: G-1 forks of one
  prefilled prompt); returns (state, ok [N], copy_from [N], copy_to [N]) for `copy_pages`."""
  def body(s, dst):
    s, ok, copy_from, copy_to = fork(s, src, dst, page_size)
    return s, (ok, copy_from, copy_to)
  state, (ok, copy_from, copy_to) = jax.lax.scan(body, state, jnp.asarray(dsts, jnp.int32))
  return state, ok, copy_from, copy_to


def release(state: PageState, row) -> PageState:
  """Drops `row`'s hold on its pages (refcount -1 each) and empties its table and length."""
  pages = state.table[row]
  refcount = _add_refs(state.refcount, pages, pages >= 0, -1)
  return state.replace(refcount=refcount, table=state.table.at[row].set(NO_PAGE),
                       length=state.length.at[row].set(0))


def release_before(state: PageState, row, pages: jax.Array) -> PageState:
  """Drops `row`'s hold on its first `pages` table slots (tokens no query of the row can see again: every layer's
  window has passed them); its length and later pages stay."""
  table = state.table[row]
  drop = (jnp.arange(table.shape[0]) < pages) & (table >= 0)
  refcount = _add_refs(state.refcount, table, drop, -1)
  return state.replace(refcount=refcount, table=state.table.at[row].set(jnp.where(drop, NO_PAGE, table)))


def move_rows(state: PageState, src: jax.Array, dst: jax.Array) -> PageState:
  """Row dst[i] (empty) takes row src[i]'s pages and length, and src[i] is emptied; no page changes hands, so
  reference counts stay (a row parked off its slot keeps its keys and values where they are)."""
  src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
  table = state.table.at[dst].set(state.table[src]).at[src].set(NO_PAGE)
  length = state.length.at[dst].set(state.length[src]).at[src].set(0)
  return state.replace(table=table, length=length)


def set_lengths(state: PageState, rows: jax.Array, lengths: jax.Array) -> PageState:
  """Rows' token counts set to `lengths` (the exact counts, where the host kept an upper bound)."""
  return state.replace(length=state.length.at[jnp.asarray(rows, jnp.int32)].set(jnp.asarray(lengths, jnp.int32)))


# ---- the page pool -------------------------------------------------------------------------------
@flax.struct.dataclass
class PagePool:
  """Keys and values of every page, heads first: [kv_heads, num_pages, page_size, head_dim], the layout of the TPU
  paged-attention kernel (`fused_attention.paged_decode_attention`), which reads a row's pages where they lie."""

  keys: tuple[jax.Array, ...]  # per layer [kv_heads, num_pages, page_size, head_dim]
  values: tuple[jax.Array, ...]
  # how a decode step reads the pages: the paged-attention kernel (`models.fused_attention`), or None: a gather
  kernel: AttentionKernel | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def init(cls, config: ModelConfig, num_pages: int, page_size: int, dtype=None,
           kernel: AttentionKernel | None = None) -> PagePool:
    dtype = dtype or cache_dtype(config.compute_dtype)
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
    return cls(keys=zeros(), values=zeros(), kernel=kernel)

  @property
  def num_pages(self) -> int:
    return self.keys[0].shape[1]

  @property
  def page_size(self) -> int:
    return self.keys[0].shape[2]


def write_layer(k_pages: jax.Array, v_pages: jax.Array, table: jax.Array, start: jax.Array, k_new: jax.Array,
                v_new: jax.Array, write_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Writes one layer's new keys/values k_new, v_new [B, T, kv_heads, head_dim] (token-major, as the
  attention projections give them) at positions start[b] + t of each row b of `table` [B, pages_per_row].

  Tokens where `write_mask` [B, T] is False, past the row's table or on a NO_PAGE entry write nothing.
  Rows must not write into pages they share (a fork's rows write past their length, into private pages).
  """
  t = k_new.shape[1]
  num_pages, page_size, m = k_pages.shape[1], k_pages.shape[2], table.shape[1]
  pos = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
  slot, offset = pos // page_size, pos % page_size
  page = jnp.take_along_axis(table, jnp.clip(slot, 0, m - 1), axis=1)
  keep = (slot < m) & (page >= 0)
  if write_mask is not None:
    keep = keep & write_mask.astype(bool)
  page = jnp.where(keep, page, num_pages)  # out of range: dropped
  # [B, T, H, D] -> [H, B, T, D], as [:, page, offset] indexes
  heads_first = lambda x: x.transpose(2, 0, 1, 3)  # noqa: E731
  k_pages = k_pages.at[:, page, offset].set(heads_first(k_new).astype(k_pages.dtype), mode="drop")
  v_pages = v_pages.at[:, page, offset].set(heads_first(v_new).astype(v_pages.dtype), mode="drop")
  return k_pages, v_pages


def gather_layer(k_pages: jax.Array, v_pages: jax.Array, table: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each row's pages laid end to end: k, v [B, kv_heads, pages_per_row * page_size, head_dim].
  NO_PAGE entries read page 0; the attention mask must hide them."""
  idx = jnp.maximum(table, 0)

  def one(pages):
    x = pages[:, idx]  # [H, B, M, P, D]
    h, b, m, p, d = x.shape
    return x.transpose(1, 0, 2, 3, 4).reshape(b, h, m * p, d)
  return one(k_pages), one(v_pages)


def copy_pages(pool: PagePool, copy_from: jax.Array, copy_to: jax.Array) -> PagePool:
  """Copies page copy_from[i] to copy_to[i] in every layer (scalars or [N]); NO_PAGE pairs are skipped."""
  src = jnp.atleast_1d(jnp.asarray(copy_from, jnp.int32))
  dst = jnp.atleast_1d(jnp.asarray(copy_to, jnp.int32))
  dst = jnp.where((src >= 0) & (dst >= 0), dst, pool.num_pages)
  src = jnp.maximum(src, 0)
  move = lambda x: x.at[:, dst].set(x[:, src], mode="drop")  # noqa: E731
  return pool.replace(keys=tuple(map(move, pool.keys)), values=tuple(map(move, pool.values)))


# ---- attention over pages --------------------------------------------------------------------------
@flax.struct.dataclass
class PagedLayer:
  """One layer of a page pool during a chunk: writes the chunk's keys and values after each row's `start`
  tokens (`write_mask` [B, T] marks the real ones) and attends over the row's pages: a decode step (one token a
  row) through the paged-attention kernel where `kernel` is set, else by gathering the pages (`paged_attention`)."""

  keys: jax.Array  # [kv_heads, num_pages, page_size, head_dim]
  values: jax.Array
  table: jax.Array  # [B, pages_per_row]
  start: jax.Array  # [B]
  write_mask: jax.Array  # [B, T]
  # the decode kernel (`models.fused_attention`; a layer with a sliding window has none: the kernel masks by length)
  kernel: AttentionKernel | None = flax.struct.field(pytree_node=False, default=None)

  def attend(self, q, k, v, mask):
    keys, values = write_layer(self.keys, self.values, self.table, self.start, k, v, self.write_mask)
    lengths = self.start + self.write_mask.sum(axis=1, dtype=jnp.int32)
    if self.kernel is not None and q.shape[1] == 1 and self.kernel.takes_head_dim(q.shape[-1]):
      out = paged_decode_attention(q, keys, values, self.table[:, :mask.shape[-1] // keys.shape[2]], lengths,
                                   self.kernel)
    else:
      out = paged_attention(q, keys, values, self.table, mask)
    return self.replace(keys=keys, values=values), out


def chunk_mask(start: jax.Array, write_mask: jax.Array, width: int) -> jax.Array:
  """Attention mask [B, T, width] for a chunk written at start[b] + t: a query sees every earlier
  token of its row and the chunk's written tokens up to itself."""
  t = write_mask.shape[1]
  s = jnp.arange(width, dtype=jnp.int32)[None, None, :]
  q = jnp.arange(t, dtype=jnp.int32)[None, :, None]
  rel = s - jnp.asarray(start, jnp.int32)[:, None, None]  # key's index within the chunk
  in_chunk = jnp.take_along_axis(write_mask.astype(bool), jnp.clip(rel[:, 0], 0, t - 1), axis=1)[:, None, :]
  return (rel < 0) | ((rel <= q) & in_chunk)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table: jax.Array,
                    mask: jax.Array) -> jax.Array:
  """Attention of q [B, T, Hq, D] over each row's pages: gathers them, then `grouped_attention`.

  mask [B, T, S] with S a multiple of the page size: only the first S / page_size pages of each row are
  read (a short attention window reads less).
  """
  page_size, width = k_pages.shape[2], mask.shape[-1]
  if width % page_size:
    raise ValueError(f"attention width {width} is not a multiple of the page size {page_size}")
  k, v = gather_layer(k_pages, v_pages, table[:, :width // page_size])
  return attend_in(k_pages.dtype, q, k, v, mask)


# ---- validation ------------------------------------------------------------------------------------
def check_page_size(page_size: int, windows: Sequence[int]) -> None:
  """Raises unless `page_size` is positive and divides every attention window / cache length."""
  bad = [w for w in windows if page_size < 1 or w % page_size]
  if page_size < 1 or bad:
    raise ValueError(f"EngineConfig.page_size={page_size} must be positive and divide every attention window "
                     f"and the cache length; it does not divide {bad or list(windows)}")


def check_prompt_fits(prompt_len: int, num_pages: int, page_size: int) -> None:
  """Raises when a prompt of `prompt_len` tokens exceeds the whole page pool."""
  if prompt_len > num_pages * page_size:
    raise ValueError(f"prompt of {prompt_len} tokens exceeds the page pool of {num_pages * page_size} tokens "
                     f"({num_pages} pages x {page_size}); raise the number of pages or shorten the prompt")
