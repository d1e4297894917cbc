"""The paged KV cache's building blocks: page bookkeeping, pool writes and gathers, attention over pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.layers import grouped_attention
from streamrl_jax.models.paged_cache import NO_PAGE, PagePool, PageState, advance, chunk_mask
from streamrl_jax.models.paged_cache import check_page_size, check_prompt_fits, copy_pages, fork, fork_many
from streamrl_jax.models.paged_cache import PagedLayer, gather_layer, paged_attention
from streamrl_jax.models.paged_cache import release, reserve, write_layer

PS = 2  # page size of the bookkeeping tests
_reserve = jax.jit(reserve, static_argnums=3)
_fork = jax.jit(fork, static_argnums=3)
_release = jax.jit(release)
_advance = jax.jit(advance)


def _np(state: PageState):
  return np.asarray(state.refcount), np.asarray(state.table), np.asarray(state.length)


def _write(state, row, n):
  """Reserves and records n more tokens in `row`; returns (state, ok)."""
  state, ok = _reserve(state, row, int(state.length[row]) + n, PS)
  if ok:
    state = _advance(state, jnp.zeros(state.rows, jnp.int32).at[row].set(n))
  return state, bool(ok)


# ---- hand-worked bookkeeping -------------------------------------------------------------------------
def test_reserve_takes_lowest_free_pages_and_refuses_what_does_not_fit():
  state = PageState.init(num_pages=5, rows=3, pages_per_row=3)
  state, ok = _reserve(state, 1, 3, PS)  # 2 pages
  assert ok
  refcount, table, length = _np(state)
  np.testing.assert_array_equal(table, [[-1, -1, -1], [0, 1, -1], [-1, -1, -1]])
  np.testing.assert_array_equal(refcount, [1, 1, 0, 0, 0])
  np.testing.assert_array_equal(length, [0, 0, 0])  # reserving writes nothing
  state, ok = _reserve(state, 0, 2, PS)
  state, ok2 = _reserve(state, 1, 5, PS)  # one more page for row 1, after its own
  assert ok and ok2
  np.testing.assert_array_equal(state.table, [[2, -1, -1], [0, 1, 3], [-1, -1, -1]])
  before = _np(state)
  state, ok = _reserve(state, 1, 7, PS)  # 4 pages > pages_per_row
  assert not ok
  state, ok2 = _reserve(state, 2, 4, PS)  # 2 pages, 1 free
  assert not ok2
  for a, b in zip(before, _np(state)):
    np.testing.assert_array_equal(a, b)
  state, ok = _reserve(state, 1, 1, PS)  # already holds enough
  assert ok and int(state.free_pages) == 1


def test_fork_shares_full_pages_and_copies_the_partial_one():
  state = PageState.init(num_pages=6, rows=3, pages_per_row=3)
  state, _ = _write(state, 0, 5)  # pages 0, 1 full; page 2 holds 1 token
  state, ok, copy_from, copy_to = _fork(state, 0, 2, PS)
  assert ok and (int(copy_from), int(copy_to)) == (2, 3)
  refcount, table, length = _np(state)
  np.testing.assert_array_equal(table, [[0, 1, 2], [-1, -1, -1], [0, 1, 3]])
  np.testing.assert_array_equal(refcount, [2, 2, 1, 1, 0, 0])
  np.testing.assert_array_equal(length, [5, 0, 5])
  state, ok, *_ = _fork(state, 0, 2, PS)  # dst not empty
  assert not ok
  state = _release(state, 0)
  refcount, table, length = _np(state)
  np.testing.assert_array_equal(refcount, [1, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(table[0], [-1, -1, -1])
  np.testing.assert_array_equal(length, [0, 0, 5])
  state, _ = _write(state, 1, 4)  # reuses the freed page 2, then page 4
  np.testing.assert_array_equal(state.table[1], [2, 4, -1])


def test_fork_of_full_pages_copies_nothing_and_fails_without_a_free_page():
  state = PageState.init(num_pages=3, rows=3, pages_per_row=3)
  state, _ = _write(state, 0, 4)
  state, ok, copy_from, copy_to = _fork(state, 0, 1, PS)
  assert ok and (int(copy_from), int(copy_to)) == (NO_PAGE, NO_PAGE)
  np.testing.assert_array_equal(state.refcount, [2, 2, 0])
  state, _ = _write(state, 0, 1)  # row 0 takes page 2 for token 4
  before = _np(state)
  state, ok, copy_from, copy_to = _fork(state, 0, 2, PS)  # needs a page for the copy: none free
  assert not ok and int(copy_to) == NO_PAGE
  for a, b in zip(before, _np(state)):
    np.testing.assert_array_equal(a, b)


def test_fork_many_forks_a_group_from_one_prompt():
  state = PageState.init(num_pages=8, rows=4, pages_per_row=2)
  state, _ = _write(state, 0, 3)
  state, ok, copy_from, copy_to = jax.jit(fork_many, static_argnums=3)(state, 0, jnp.array([1, 2, 3]), PS)
  np.testing.assert_array_equal(ok, [True, True, True])
  np.testing.assert_array_equal(copy_from, [1, 1, 1])
  np.testing.assert_array_equal(copy_to, [2, 3, 4])
  np.testing.assert_array_equal(state.table, [[0, 1], [0, 2], [0, 3], [0, 4]])
  np.testing.assert_array_equal(state.refcount, [4, 1, 1, 1, 1, 0, 0, 0])


# ---- random sequences of operations --------------------------------------------------------------------
P, ROWS, M = 6, 4, 3
_ops = st.lists(st.tuples(st.sampled_from(["write", "fork", "release"]), st.integers(0, ROWS - 1),
                          st.integers(0, ROWS - 1), st.integers(1, 4)), max_size=25)


def _check_invariants(state: PageState):
  refcount, table, length = _np(state)
  held = np.bincount(table[table >= 0], minlength=P)
  np.testing.assert_array_equal(refcount, held)  # a page's refcount is the number of rows holding it
  assert int(state.free_pages) + int((refcount > 0).sum()) == P
  for row in range(ROWS):
    n = int((table[row] >= 0).sum())
    assert (table[row, :n] >= 0).all() and (table[row, n:] == NO_PAGE).all()  # pages fill from the left
    assert len(set(table[row, :n])) == n
    assert length[row] <= n * PS


@settings(max_examples=40, deadline=None)
@given(_ops)
def test_random_operations_keep_the_books_straight(ops):
  state = PageState.init(P, ROWS, M)
  for op, a, b, n in ops:
    refcount, table, length = _np(state)
    if op == "write":
      need = -(-(length[a] + n) // PS) - (table[a] >= 0).sum()
      free = np.flatnonzero(refcount == 0)
      expect_ok = length[a] + n <= M * PS and max(need, 0) <= len(free)
      state, ok = _write(state, a, n)
      assert ok == expect_ok
      if ok and need > 0:  # the lowest free pages, freed ones included
        np.testing.assert_array_equal(np.asarray(state.table[a])[(table[a] >= 0).sum():][:need], free[:need])
    elif op == "fork":
      state, ok, copy_from, copy_to = _fork(state, a, b, PS)
      empty = (table[b] == NO_PAGE).all() and length[b] == 0
      partial = length[a] % PS != 0
      assert bool(ok) == (empty and (not partial or (refcount == 0).any()))
      if ok:
        assert int(state.length[b]) == length[a]
        assert (int(copy_to) >= 0) == partial
        if partial:
          assert int(copy_from) == table[a, length[a] // PS] and refcount[int(copy_to)] == 0
    else:
      state = _release(state, a)
    _check_invariants(state)
  for row in range(ROWS):
    state = _release(state, row)
  np.testing.assert_array_equal(state.refcount, np.zeros(P))
  assert int(state.free_pages) == P


# ---- pool writes and gathers ---------------------------------------------------------------------------
H, D, PAGE = 2, 4, 4


def _reference_write(ref, start, k_new, mask):
  """Contiguous reference [B, H, S, D] with k_new [B, T, H, D] written at start[b] + t where mask."""
  for b in range(k_new.shape[0]):
    for t in range(k_new.shape[1]):
      if mask[b, t]:
        ref[b, :, start[b] + t] = k_new[b, t]


@functools.cache
def _jitted():
  return jax.jit(write_layer), jax.jit(gather_layer)


def test_write_then_gather_matches_a_contiguous_cache():
  rng = np.random.default_rng(0)
  rows, m, num_pages, t = 3, 3, 10, 5
  write, gather = _jitted()
  perm = rng.permutation(num_pages)  # pages in a random order, some rows holding fewer
  table = np.full((rows, m), NO_PAGE, np.int32)
  table[0], table[1, :2], table[2, :1] = perm[:3], perm[3:5], perm[5:6]
  k_pages = jnp.zeros((H, num_pages, PAGE, D))
  v_pages = jnp.zeros((H, num_pages, PAGE, D))
  ref_k, ref_v = np.zeros((rows, H, m * PAGE, D), np.float32), np.zeros((rows, H, m * PAGE, D), np.float32)
  # a prefill-sized chunk, then a chunk with masked tokens (and row 2 masked past its single page)
  starts = [np.array([0, 0, 0]), np.array([5, 3, 0])]
  masks = [np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], bool),
           np.array([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 1, 0]], bool)]
  for start, mask in zip(starts, masks):
    k_new = rng.normal(size=(rows, t, H, D)).astype(np.float32)
    v_new = rng.normal(size=(rows, t, H, D)).astype(np.float32)
    k_pages, v_pages = write(k_pages, v_pages, table, start, k_new, v_new, mask)
    _reference_write(ref_k, start, k_new, mask)
    _reference_write(ref_v, start, v_new, mask)
  k, v = gather(k_pages, v_pages, table)
  held = (table >= 0).repeat(PAGE, axis=1)[:, None, :, None]  # what NO_PAGE entries gather is masked anyway
  np.testing.assert_array_equal(np.where(held, k, 0), ref_k)
  np.testing.assert_array_equal(np.where(held, v, 0), ref_v)
  unused = np.setdiff1d(np.arange(num_pages), table[table >= 0])
  assert not np.asarray(k_pages)[:, unused].any()  # masked writes and writes past a row's pages wrote nothing


def test_forked_rows_share_the_prompt_and_diverge_after_it():
  rng = np.random.default_rng(1)
  config = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=H, head_dim=D)
  pool, state = PagePool.init(config, num_pages=8, page_size=PAGE), PageState.init(8, 3, 3)
  write, gather = _jitted()
  prompt_k = rng.normal(size=(3, 5, H, D)).astype(np.float32)  # only row 0's is written
  state, _ = _reserve(state, 0, 5, PAGE)
  prefill_mask = np.array([[1] * 5, [0] * 5, [0] * 5], bool)
  k, v = write(pool.keys[0], pool.values[0], state.table, state.length, prompt_k, prompt_k, prefill_mask)
  pool, state = pool.replace(keys=(k,), values=(v,)), _advance(state, jnp.array([5, 0, 0]))
  state, ok, copy_from, copy_to = jax.jit(fork_many, static_argnums=3)(state, 0, jnp.array([1, 2]), PAGE)
  assert ok.all()
  pool = copy_pages(pool, copy_from, copy_to)
  decode_k = rng.normal(size=(3, 5, H, D)).astype(np.float32)  # 5 tokens each, one row at a time
  for r in range(3):
    state, _ = _reserve(state, r, 10, PAGE)
  k, v = write(pool.keys[0], pool.values[0], state.table, state.length, decode_k, decode_k, np.ones((3, 5), bool))
  k, _ = gather(k, v, state.table)
  for r in range(3):
    np.testing.assert_array_equal(k[r, :, :5], prompt_k[0].transpose(1, 0, 2))
    np.testing.assert_array_equal(k[r, :, 5:10], decode_k[r].transpose(1, 0, 2))
  assert int(state.table[1, 0]) == int(state.table[2, 0]) == int(state.table[0, 0])


def test_copy_pages_skips_missing_ids():
  config = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=4)
  pool = PagePool.init(config, num_pages=3, page_size=2)
  pool = pool.replace(keys=tuple(k.at[:, 0].set(1.0) for k in pool.keys))
  moved = copy_pages(pool, jnp.array([0, -1]), jnp.array([2, 1]))
  for k in moved.keys:
    np.testing.assert_array_equal(k[0, :, 0, 0], [1.0, 0.0, 1.0])
  assert pool.num_pages == 3 and pool.page_size == 2


# ---- attention over pages -------------------------------------------------------------------------------
def test_paged_attention_equals_grouped_attention_on_contiguous_keys():
  rng = np.random.default_rng(2)
  b, t, hq, m, num_pages = 2, 3, 4, 3, 7
  table = np.array([[4, 0, 6], [2, 5, NO_PAGE]], np.int32)
  k_pages = rng.normal(size=(H, num_pages, PAGE, D)).astype(np.float32)
  v_pages = rng.normal(size=(H, num_pages, PAGE, D)).astype(np.float32)
  q = rng.normal(size=(b, t, hq, D)).astype(np.float32)
  start = np.array([6, 2])
  mask = np.asarray(chunk_mask(start, np.array([[1, 1, 1], [1, 0, 1]], bool), m * PAGE))
  np.testing.assert_array_equal(mask[1, 2, :6], [1, 1, 1, 0, 1, 0])  # earlier tokens, not masked ones
  contiguous_k = np.stack([np.concatenate([k_pages[:, p] for p in np.maximum(row, 0)], axis=1) for row in table])
  contiguous_v = np.stack([np.concatenate([v_pages[:, p] for p in np.maximum(row, 0)], axis=1) for row in table])
  want = grouped_attention(q, contiguous_k, contiguous_v, mask)
  got = jax.jit(paged_attention)(q, k_pages, v_pages, table, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # a short window reads only the first pages
  got_short = paged_attention(q, k_pages, v_pages, table, mask[..., :2 * PAGE])
  want_short = grouped_attention(q, contiguous_k[:, :, :8], contiguous_v[:, :, :8], mask[..., :8])
  np.testing.assert_allclose(got_short, want_short, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="multiple of the page size"):
    paged_attention(q, k_pages, v_pages, table, mask[..., :5])


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 1, 2)])
def test_the_decode_kernel_matches_the_gather_form(mesh_shape):
  """A decode step (one token a row) through the Pallas paged-attention kernel in interpret mode, heads split over
  "tensor" or not, against the gather form: bfloat16 keys and values (the kernel reads them so), rows of 1 to 19
  tokens on pages in a random order, an empty slot among them."""
  from jax.sharding import Mesh

  from streamrl_jax.models.fused_attention import AttentionKernel
  rng = np.random.default_rng(3)
  b, hq, kv_heads, dim, page, m, num_pages = 3, 4, 2, 128, 4, 8, 30
  table = rng.permutation(num_pages)[:b * m].reshape(b, m).astype(np.int32)
  start = np.array([18, 3, 0])
  write = np.array([[1], [1], [0]], bool)  # the last slot is idle: it writes nothing and its output is unused
  k_pages, v_pages = (jnp.asarray(rng.normal(size=(kv_heads, num_pages, page, dim)), jnp.bfloat16) for _ in range(2))
  q, k, v = (jnp.asarray(rng.normal(size=(b, 1, h, dim)), jnp.bfloat16) for h in (hq, kv_heads, kv_heads))
  mask = chunk_mask(start, write, m * page)
  devices = np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape)
  kernel = AttentionKernel(Mesh(devices, ("data", "fsdp", "tensor")), interpret=True)
  layer = lambda kernel: PagedLayer(k_pages, v_pages, table, start, write, kernel)  # noqa: E731
  _, got = layer(kernel).attend(q, k, v, mask)
  _, want = layer(None).attend(q, k, v, mask)
  live = write[:, 0]
  np.testing.assert_allclose(np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live], atol=2e-2,
                             rtol=2e-2)
  assert np.abs(np.asarray(got, np.float32)[live] - np.asarray(want, np.float32)[live]).max() > 0  # not one path


# ---- validation -------------------------------------------------------------------------------------------
def test_validation_errors_name_the_setting_and_sizes():
  check_page_size(16, (64, 128))
  with pytest.raises(ValueError, match=r"EngineConfig\.page_size=16 .*\[72\]"):
    check_page_size(16, (64, 72))
  with pytest.raises(ValueError, match="EngineConfig.page_size=0"):
    check_page_size(0, (64,))
  check_prompt_fits(64, 4, 16)
  with pytest.raises(ValueError, match="prompt of 65 tokens exceeds the page pool of 64 tokens"):
    check_prompt_fits(65, 4, 16)
