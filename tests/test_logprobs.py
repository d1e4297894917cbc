"""Log-probabilities over vocabulary chunks: the same values and gradients as the plain log-softmax path, and the
trainer's memory estimate against XLA's own memory analysis."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Scoring, Trainer, TrainerConfig
from streamrl_jax.training import host_batch
from streamrl_jax.training.trainer import compiled_memory
from streamrl_jax.training.logprobs import (at_columns, chunked_scorer, chunked_token_logprobs, every_column,
                                           logits_scorer, scored_columns, token_logprobs, vocab_chunk)
from streamrl_jax.training.packing import call_bytes, chunk_tokens_for
from tests.xla_flags import USERS_COMPILER


def _numpy_reference(hidden, head, tokens, temperature):
  """log p and entropy from the logits in float64, by the textbook formulas."""
  logits = np.einsum("bth,hv->btv", hidden.astype(np.float64), head.astype(np.float64))[:, :-1] / temperature
  shifted = logits - logits.max(-1, keepdims=True)
  logp_all = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  ent = -(np.exp(logp_all) * logp_all).sum(-1)
  pad = np.zeros((len(tokens), 1))
  return np.concatenate([pad, picked], 1), np.concatenate([pad, ent], 1)


@pytest.mark.parametrize("vocab,chunk,temperature", [(96, 32, 1.0), (100, 32, 0.7), (50, 8192, 1.3)])
def test_chunked_matches_the_plain_path_in_value_and_gradient(vocab, chunk, temperature):
  rng = np.random.default_rng(vocab)
  hidden = rng.normal(size=(3, 6, 16)).astype(np.float32) * 0.5
  head = rng.normal(size=(16, vocab)).astype(np.float32) * 0.5
  tokens = rng.integers(0, vocab, size=(3, 6)).astype(np.int32)
  weights = rng.normal(size=(2, 3, 6)).astype(np.float32)

  def plain(h, w):
    return token_logprobs((h @ w) / temperature, jnp.asarray(tokens))

  def chunked(h, w):
    return chunked_token_logprobs(h, w, jnp.asarray(tokens), temperature, chunk)

  def chunked_tied(h, w):  # the same weights stored as tied embeddings [vocab, hidden]
    return chunked_token_logprobs(h, w.T, jnp.asarray(tokens), temperature, chunk, vocab_axis=0)

  want = _numpy_reference(hidden, head, tokens, temperature)
  for fn in (plain, chunked, chunked_tied):
    logp, ent = jax.jit(fn)(hidden, head)
    np.testing.assert_allclose(logp, want[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, want[1], atol=1e-5, rtol=1e-5)

  def loss(fn):
    return lambda h, w: jnp.sum(fn(h, w)[0] * weights[0]) + jnp.sum(fn(h, w)[1] * weights[1])

  grads = [jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(hidden, head) for fn in (plain, chunked, chunked_tied)]
  for a, b, c in zip(*grads):
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(c, a, atol=1e-5, rtol=1e-5)
    assert np.abs(a).max() > 1e-2  # a gradient that is there to compare

  def frozen_head(h, w):  # LoRA's: the head's gradient skipped, the hidden states' unchanged
    return chunked_token_logprobs(h, w, jnp.asarray(tokens), temperature, chunk, head_grad=False)
  g_hidden, g_head = jax.jit(jax.grad(loss(frozen_head), argnums=(0, 1)))(hidden, head)
  np.testing.assert_allclose(g_hidden, grads[0][0], atol=1e-5, rtol=1e-5)
  assert not np.asarray(g_head).any()


def test_vocab_chunk_divides_the_vocabulary_when_it_can():
  assert vocab_chunk(49152, 8192) == 8192
  assert vocab_chunk(151936, 8192) == 4748  # 151936 = 32 * 4748: no padded copy of a 0.5 GB head
  assert vocab_chunk(1009, 256) == 256  # a prime vocabulary: padded
  assert vocab_chunk(100, 0) == vocab_chunk(100, 500) == 100


def _trainer(config, chunk, remat="none", kl=0.0):
  model = Transformer(config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  trainer = Trainer(graphdef, OptimizerConfig(), ObjectiveConfig(objective="ppo", kl_coef=kl), single_device_mesh(),
                    scoring=Scoring(0.8, ref_params=params if kl else None),
                    config=TrainerConfig(logprob_chunk=chunk, remat=remat))
  return trainer, trainer.init_state(params)


TINY = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   tie_embeddings=True)


@pytest.mark.parametrize("tied", [True, False])
def test_the_trainer_gives_one_gradient_with_and_without_chunks(tied):
  rng = np.random.default_rng(0)
  batch = dict(tokens=rng.integers(0, 100, (8, 16)).astype(np.int32), valid=np.ones((8, 16), bool),
               loss_mask=np.arange(16)[None].repeat(8, 0) >= 4, advantages=rng.normal(size=8).astype(np.float32),
               logprobs=-rng.random((8, 16)).astype(np.float32))
  sums = []
  for chunk in (0, 32):  # the tied head read as embeddings [vocab, hidden], the untied one as [hidden, vocab]
    trainer, state = _trainer(dataclasses.replace(TINY, tie_embeddings=tied), chunk, kl=0.1)
    state = trainer.accumulate(state, batch)
    sums.append(jax.device_get((state.grad_sum, state.sums)))
  for a, b in zip(jax.tree.leaves(sums[0]), jax.tree.leaves(sums[1])):
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4)


def test_chunks_cut_memory_and_the_estimate_bounds_xlas_analysis():
  """XLA's memory analysis of one accumulation: the chunked path holds [tokens, chunk], not [tokens, vocab]; the
  micro-batcher's estimate of a call's temporaries (`call_bytes`) is above what XLA assigns, by at most a fifth."""
  config = dataclasses.replace(TINY, vocab_size=4096, hidden_size=64, intermediate_size=256, num_layers=4)
  temps = {}
  for chunk, kl in ((0, 0.0), (256, 0.0), (256, 0.1)):
    trainer, state = _trainer(config, chunk, kl=kl)
    temps[chunk, kl] = compiled_memory(trainer, state, 8, 64)["temp"]
    estimate = call_bytes(config, 8 * 64, 64, trainer.config, "cpu", reference=kl > 0)
    assert temps[chunk, kl] <= estimate <= 1.2 * temps[chunk, kl], (chunk, kl, estimate, temps)
  full_logits = 8 * 64 * 4096 * 4
  assert temps[0, 0.0] - temps[256, 0.0] > 2 * full_logits, temps  # several [tokens, vocab] buffers gone


def test_a_budget_that_cannot_hold_one_row_names_the_smallest_that_can():
  gradient, row = call_bytes(TINY, 0, 64, TrainerConfig()), call_bytes(TINY, 64, 64, TrainerConfig())
  per_token = (row - gradient) // 64
  assert chunk_tokens_for(TINY, 64, 10_000, 1 << 30, TrainerConfig()) == 10_000 // 64 * 64
  assert chunk_tokens_for(TINY, 64, 10_000, gradient + 3 * 64 * per_token, TrainerConfig()) == 3 * 64
  with pytest.raises(ValueError,
                     match=f"holds 63 tokens after the .* smallest budget that works is {-(-row // 2**20)}"):
    chunk_tokens_for(TINY, 64, 10_000, gradient + 63 * per_token, TrainerConfig())


def test_scored_columns_lists_each_rows_loss_tokens_or_declines():
  mask = np.zeros((3, 20), bool)
  mask[0, [3, 4, 5, 19]] = True
  mask[1, 10:18] = True  # rows: 8 + 4 = 12 columns of 20 each -> K = 16
  np.testing.assert_array_equal(scored_columns(mask), [[3, 4, 5, 19] + [20] * 12, list(range(10, 18)) + [20] * 8,
                                                       [20] * 16])
  mask[2, 1:18] = True  # 17 > 16: every column is scored
  assert scored_columns(mask) is None
  assert scored_columns(np.zeros((2, 8), bool)) is None  # K = 8 would score every column anyway


@settings(max_examples=12, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=12, max_size=12), min_size=2, max_size=4), st.booleans())
def test_scoring_the_loss_columns_alone_keeps_their_values_and_gradients(rows, chunked):
  mask = np.array(rows)
  mask[:, 0] = False
  mask[:, 9:] = False  # at most 8 = K of a row's 12 columns
  rng = np.random.default_rng(len(rows))
  hidden = rng.normal(size=(len(rows), 12, 16)).astype(np.float32)
  head = rng.normal(size=(16, 40)).astype(np.float32) * 0.5
  tokens = jnp.asarray(rng.integers(0, 40, size=(len(rows), 12)))
  weights = rng.normal(size=(2, len(rows), 12)).astype(np.float32) * mask
  columns = jnp.asarray(scored_columns(mask))

  def scored(h, w, at):
    score = chunked_scorer(w, 0.9, 16) if chunked else logits_scorer(lambda x: x @ w, 0.9)
    return (every_column(score, h, tokens) if at is None else at_columns(score, h, tokens, at))[:2]  # (no outside)

  whole, only = scored(hidden, head, None), scored(hidden, head, columns)
  for a, b in zip(whole, only):
    np.testing.assert_allclose(np.asarray(b)[mask], np.asarray(a)[mask], rtol=1e-5, atol=1e-6)
    assert not np.asarray(b)[~mask].any()
  loss = lambda h, w, at: sum(jnp.sum(v * weights[i]) for i, v in enumerate(scored(h, w, at)))  # noqa: E731
  for a, b in zip(jax.grad(loss, argnums=(0, 1))(hidden, head, None), jax.grad(loss, argnums=(0, 1))(hidden, head,
                                                                                                   columns)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 32])
def test_the_trainer_scores_only_the_loss_columns_with_the_same_gradient(monkeypatch, chunk):
  """Prompt tokens skip the head: the prepared call carries `head_columns`, the gradient and sums equal the
  every-column call's (a KL reference scored the same way), and XLA counts fewer FLOPs for it: from full logits,
  the head's 8 x hidden x vocab a position (policy forward and backward, reference forward) for each skipped one."""
  rng = np.random.default_rng(1)
  mask = np.arange(16)[None].repeat(8, 0) >= 9  # 7 loss tokens of 16 columns (K = 8)
  batch = dict(tokens=rng.integers(0, 100, (8, 16)).astype(np.int32), valid=np.ones((8, 16), bool),
               loss_mask=mask, advantages=rng.normal(size=8).astype(np.float32),
               logprobs=-rng.random((8, 16)).astype(np.float32))
  results, flops = [], []
  for skip in (True, False):
    if not skip:
      monkeypatch.setattr(host_batch, "scored_columns", lambda loss_mask: None)
    trainer, state = _trainer(TINY, chunk, kl=0.1)
    prepared = trainer.prepare(batch)
    assert ("head_columns" in prepared) == skip
    results.append(jax.device_get(trainer.accumulate(state, batch)))
    lowered = trainer._accumulate.lower(state.params, (state.grad_sum, state.sums), prepared, trainer.frozen, None)
    cost = lowered.compile(USERS_COMPILER).cost_analysis()
    flops.append((cost[0] if isinstance(cost, list) else cost)["flops"])
  for a, b in zip(jax.tree.leaves((results[0].grad_sum, results[0].sums)),
                  jax.tree.leaves((results[1].grad_sum, results[1].sums))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  skipped = 8 * (15 - 8)  # positions a row of 16 predicts, less K
  assert flops[1] - flops[0] >= (0.9 * skipped * 8 * TINY.hidden_size * TINY.vocab_size if chunk == 0 else 1), flops


@pytest.mark.parametrize("kv_layout,top_p", [("contiguous", 1.0), ("paged", 1.0), ("contiguous", 0.9)])
def test_the_samplers_logprobs_are_the_trainers_alone_padded_and_packed(kv_layout, top_p):
  """At equal weights in float32 the engine's log-probabilities of what it sampled equal the trainer's within 1e-5,
  whether the trainer scores a sequence alone, padded or packed with others: the compute part of the mismatch is
  ~0 and a sequence's scores do not depend on its call's other rows. With top-p 0.9 the trainer's are over the
  support it rebuilds, renormalised: the sampler's truncated ones."""
  from streamrl_jax.training.logprobs import Truncation
  from streamrl_jax.sampling import EngineConfig, StreamingSampler, make_engine
  from streamrl_jax.training.logprob_parity import max_abs_gaps
  from streamrl_jax.types import SamplingParams
  config = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  engine = make_engine(graphdef, config, EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=32,
                                                      min_prefill_bucket=8, kv_layout=kv_layout, steps_per_sync=4),
                       single_device_mesh(jax.devices()[0]))
  sampler = StreamingSampler([engine], params, seed=1)
  rng = np.random.default_rng(0)
  for group in range(4):
    sampler.submit([int(t) for t in rng.integers(3, 500, rng.integers(3, 14))],
                   SamplingParams(temperature=0.8, max_new_tokens=int(rng.integers(5, 24)), top_p=top_p),
                   group_id=group)
  samples = list(sampler.stream())
  truncation = Truncation(top_p=top_p)
  gaps = max_abs_gaps(graphdef, params, samples, 0.8, truncation=truncation)
  assert set(gaps) == {"alone", "padded", "packed"} and max(gaps.values()) <= 1e-5, gaps
  shifted = [dataclasses.replace(s, logprobs=np.asarray(s.logprobs) + 1e-3) for s in samples]
  assert min(max_abs_gaps(graphdef, params, shifted, 0.8, truncation=truncation).values()) > 5e-4  # it can fail
  if top_p < 1:  # scored over the whole vocabulary instead, the truncated tokens' ratios are biased
    assert min(max_abs_gaps(graphdef, params, samples, 0.8).values()) > 1e-3


@pytest.mark.parametrize("chunk", [0, 32])
def test_a_truncated_support_is_scored_renormalised_in_value_and_gradient(chunk):
  """With the sampler's top-k or top-p the trainer's log pi and entropy are those of the tempered logits at or above
  the support's floor, renormalised (numpy in float64 below), by either path; the gradient matches the full-logits
  path's; a token below the floor is scored inside a support lowered to it and counted as outside."""
  from streamrl_jax.training.logprobs import Truncation
  rng = np.random.default_rng(4)
  hidden = rng.normal(size=(3, 9, 16)).astype(np.float32)
  head = rng.normal(size=(16, 96)).astype(np.float32) * 0.6
  tokens = rng.integers(0, 96, size=(3, 9)).astype(np.int32)
  logits = np.einsum("bth,hv->btv", hidden.astype(np.float64), head.astype(np.float64))[:, :-1] / 0.8
  tokens[:, 1:] = np.argsort(-logits, axis=-1)[..., 2]  # the third most likely: inside top-3, not always top-p 0.9
  tokens[0, 3] = int(np.argsort(-logits[0, 2])[40])  # one token deep in the tail: outside either support
  for truncation, keep in ((Truncation(top_k=3), lambda row: np.sort(row)[-3]),
                           (Truncation(top_p=0.9), lambda row: _top_p_floor(row, 0.9)),
                           (Truncation(min_p=0.05), lambda row: row[row >= row.max() + np.log(0.05)].min())):
    def scored(h, w):
      score = chunked_scorer(w, 0.8, chunk, truncation=truncation) if chunk else logits_scorer(lambda x: x @ w, 0.8,
                                                                                                truncation)
      return every_column(score, h, jnp.asarray(tokens))
    logp, ent, outside = jax.jit(scored)(hidden, head)
    assert bool(outside[0, 3]) and not outside.all()
    for b in range(3):
      for t in range(8):
        row = logits[b, t]
        floor = min(keep(row), row[tokens[b, t + 1]])
        kept = row[row >= floor]
        lse = np.log(np.exp(kept - kept.max()).sum()) + kept.max()
        np.testing.assert_allclose(logp[b, t + 1], row[tokens[b, t + 1]] - lse, atol=2e-5)
        p = np.exp(kept - lse)
        np.testing.assert_allclose(ent[b, t + 1], -(p * (kept - lse)).sum(), atol=2e-5)
        assert bool(outside[b, t + 1]) == (row[tokens[b, t + 1]] < keep(row))
    full = lambda h, w: every_column(logits_scorer(lambda x: x @ w, 0.8, truncation), h, jnp.asarray(tokens))  # noqa
    loss = lambda fn: lambda h, w: jnp.sum(fn(h, w)[0]) + 0.3 * jnp.sum(fn(h, w)[1])  # noqa: E731
    for a, b in zip(jax.grad(loss(scored), argnums=(0, 1))(hidden, head), jax.grad(loss(full), argnums=(0, 1))(hidden,
                                                                                                              head)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _top_p_floor(row: np.ndarray, p: float) -> float:
  """The smallest logit of the smallest set of largest logits whose softmax mass reaches p."""
  order = np.sort(row)[::-1]
  mass = np.cumsum(np.exp(order - order.max()) / np.exp(order - order.max()).sum())
  return float(order[int(np.argmax(mass >= p))])
