"""Streamed micro-batch accumulation equals the full batch; checkpoints round trip and resume exactly."""

import dataclasses
import re
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import Transformer
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Trainer, TrainerConfig
from streamrl_jax.training.checkpoint import Checkpointer
from streamrl_jax.training.corrections import CorrectionConfig
from streamrl_jax.training.objectives import ValueLossConfig
from streamrl_jax.training.logprobs import token_logprobs
from tests.trainer_setup import CONFIG, MESH_SHAPE, make_batch, mean_gradient, split_rows, trainer_for
from tests.xla_flags import USERS_COMPILER


@pytest.fixture(scope="module")
def model_parts():
  return nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"])
def test_unequal_micro_batches_give_the_full_batch_gradient(model_parts, mode):
  graphdef, params = model_parts
  trainer = trainer_for(graphdef, ObjectiveConfig(correction=("geometric_tis", "token_mask", "veto"), aggregation=mode,
                                                  constant_normalizer=16.0,
                                                  kl_coef=0.0, entropy_coef=0.01))
  batch = make_batch(13, seed=1)
  full = trainer.accumulate(trainer.init_state(params), batch)
  streamed = trainer.init_state(params)
  for part in split_rows(batch, [5, 1, 7]):
    streamed = trainer.accumulate(streamed, part)
  np.testing.assert_allclose(float(streamed.sums["denominator"]), float(full.sums["denominator"]))
  for a, b in zip(jax.tree.leaves(mean_gradient(streamed)), jax.tree.leaves(mean_gradient(full))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert trainer.compiled_shapes == {(8, 16), (16, 16)}


def test_old_logprobs_default_to_the_trainers_own_policy_before_the_step(model_parts):
  """The pipeline sends no old_logprobs: within a step every micro-batch is accumulated at the same
  parameters, so the policy before the step is the current one, and the gradient equals the one with the
  trainer's own log-probabilities given explicitly (and differs from the sampler's standing in for them)."""
  graphdef, params = model_parts
  trainer = trainer_for(graphdef, ObjectiveConfig(bands=CorrectionConfig(tis_cap=50.0)))
  batch = make_batch(6, seed=3)
  del batch["old_logprobs"]
  model = nnx.merge(graphdef, params)
  own = np.asarray(token_logprobs(model(batch["tokens"], batch["valid"]), batch["tokens"])[0])
  default = mean_gradient(trainer.accumulate(trainer.init_state(params), batch))
  given = mean_gradient(trainer.accumulate(trainer.init_state(params), dict(batch, old_logprobs=own)))
  sampler = mean_gradient(trainer.accumulate(trainer.init_state(params),
                                             dict(batch, old_logprobs=batch["logprobs"])))
  for a, b, c in zip(jax.tree.leaves(default), jax.tree.leaves(given), jax.tree.leaves(sampler)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  assert max(float(np.abs(a - c).max()) for a, c in zip(jax.tree.leaves(default), jax.tree.leaves(sampler))) > 1e-4
  bypass = trainer_for(graphdef, ObjectiveConfig(old_logprobs="sampler", correction="none"))
  bypassed = mean_gradient(bypass.accumulate(bypass.init_state(params), batch))  # the sampler's, as configured
  for a, c in zip(jax.tree.leaves(bypassed), jax.tree.leaves(sampler)):  # (given as old: its correction weighs 1)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-8)


def test_optimizer_runs_once_per_global_batch(model_parts):
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  state = trainer.init_state(params)
  before = jax.tree.map(np.asarray, state.params)
  for part in split_rows(make_batch(12, seed=2), [4, 8]):
    state = trainer.accumulate(state, part)
  assert int(state.step) == 0
  np.testing.assert_array_equal(np.asarray(state.params["embed"][...]), before["embed"])
  state, metrics = trainer.apply(state)
  assert int(state.step) == 1 and metrics["tokens"] > 0 and metrics["grad_norm"] > 0
  assert not np.array_equal(np.asarray(state.params["embed"][...]), before["embed"])
  assert float(state.sums["denominator"]) == 0
  # the sum starts again: the next batch's gradient alone, as on a fresh state at the new parameters
  batch = make_batch(6, seed=5)
  after = trainer.accumulate(state, batch)
  fresh = trainer.accumulate(trainer.init_state(jax.tree.map(np.asarray, state.params)), batch)
  for a, b in zip(jax.tree.leaves(after.grad_sum), jax.tree.leaves(fresh.grad_sum)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, empty = trainer.apply(trainer.apply(after)[0])  # an update with nothing accumulated moves by no gradient
  assert empty["grad_norm"] == 0 and empty["tokens"] == 0


def test_the_update_neither_copies_nor_rewrites_the_summed_gradient(model_parts):
  """Zeroing the summed gradient in the update wrote it whole, and XLA copied it first (the update reads it): a
  copy of every leaf. The update now leaves it (the next accumulation restarts it): no copy in the program."""
  graphdef, params = model_parts
  trainer = trainer_for(graphdef, mesh_devices=(0, 1), shape=MeshShape(1, 1, 1))  # one device: names kept
  state = trainer.accumulate(trainer.init_state(params), make_batch(8, seed=1))
  hlo = trainer._apply.lower(state).compile(USERS_COMPILER).as_text()
  assert "state_grad_sum" in hlo  # the parameters' names, which the search below reads
  assert not re.findall(r"copy\(%state_grad_sum", hlo)


def test_precompile_covers_every_bucket_and_changes_nothing(model_parts):
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  state = trainer.precompile(trainer.init_state(params), max_rows=12, max_length=20)
  assert trainer.compiled_shapes == {(8, 16), (16, 16), (8, 32), (16, 32)}
  assert float(state.sums["denominator"]) == 0 and float(state.sums["tokens"]) == 0
  assert all(float(abs(g).max()) == 0 for g in jax.tree.leaves(state.grad_sum))
  for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_steps(trainer, state, seeds, before_update=lambda: None):
  for seed in seeds:
    for part in split_rows(make_batch(10, seed), [3, 7]):
      state = trainer.accumulate(state, part)
    before_update()
    state, _ = trainer.apply(state)
  return state


@pytest.mark.parametrize("mode", ["synchronous", "background", "asynchronous"])
def test_checkpoint_resume_is_bit_identical_and_restores_onto_another_mesh(model_parts, tmp_path, mode):
  """Synchronous and background saves write the state's own buffers (a background one while the next step
  accumulates, which reads them without donating them; the update waits for it), asynchronous ones a private
  copy: either way the checkpoint holds the state as it was saved."""
  graphdef, params = model_parts
  trainer = trainer_for(graphdef, warmup_steps=2, schedule="cosine", decay_steps=10)
  checkpointer = Checkpointer(tmp_path, max_to_keep=2, async_save=mode == "asynchronous",
                              background=mode == "background")
  state = run_steps(trainer, trainer.init_state(params, seed=5), [10, 11])
  checkpointer.save(state, extra={"data_position": 20, "ranker": {"steps": 3}})
  saved_params = jax.tree.map(np.asarray, state.params)
  straight = run_steps(trainer, state, [12, 13], before_update=checkpointer.wait)  # donates `state` at its update
  resumed, extra = checkpointer.restore(trainer.init_state(params))
  assert extra == {"data_position": 20, "ranker": {"steps": 3}} and int(resumed.step) == 2
  resumed = run_steps(trainer, resumed, [12, 13])
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(straight.opt_state), jax.tree.leaves(resumed.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = trainer_for(graphdef, mesh_devices=(0, 2), shape=MeshShape(1, 1, 2), warmup_steps=2, schedule="cosine",
                      decay_steps=10)
  moved, _ = checkpointer.restore(other.init_state(params))
  leaf = moved.params["layers"][0]["mlp"]["up_proj"][...]
  assert leaf.sharding.mesh.shape["tensor"] == 2 and set(leaf.sharding.device_set) == set(jax.devices()[:2])
  for a, b in zip(jax.tree.leaves(moved.params), jax.tree.leaves(saved_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  checkpointer.close()


def test_accumulation_leaves_the_saved_arrays_whole_and_the_update_donates_them(model_parts):
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  state = trainer.init_state(params)
  kept = jax.tree.leaves((state.params, state.opt_state))
  stepped = trainer.accumulate(state, make_batch(10, 1))
  assert not any(leaf.is_deleted() for leaf in kept)  # what a background save reads is still there
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.grad_sum))  # the sums were donated
  trainer.apply(stepped)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(stepped.params))


def test_a_background_save_returns_at_once_commits_before_it_is_read_and_names_its_failure(model_parts, tmp_path):
  graphdef, params = model_parts
  state = trainer_for(graphdef).init_state(params)
  checkpointer = Checkpointer(tmp_path, max_to_keep=2)
  assert checkpointer.background and not checkpointer.async_save  # the CPU's default
  release, writing = threading.Event(), threading.Event()
  write = checkpointer._write

  def held(step, items):
    writing.set()
    assert release.wait(60)
    write(step, items)
  checkpointer._write = held
  checkpointer.save(state, step=1)  # returns while the write is held
  assert writing.wait(60) and not (tmp_path / "1").exists()
  release.set()
  assert checkpointer.steps == [1]  # committed before it is listed
  checkpointer._write = lambda step, items: (_ for _ in ()).throw(OSError("No space left on device"))
  checkpointer.save(state, step=2)
  with pytest.raises(OSError, match=r"the checkpoint of step 2 in .* was not saved: No space left on device"):
    checkpointer.wait()
  assert checkpointer.latest_step() == 1
  checkpointer.close()


def test_keeps_the_last_n_checkpoints(model_parts, tmp_path):
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  checkpointer = Checkpointer(tmp_path, max_to_keep=2)
  assert not checkpointer.async_save  # the CPU backend: orbax's synchronous save (on a thread of its own)
  state = trainer.init_state(params)
  for _ in range(3):
    state = dataclasses.replace(state, step=state.step + 1)
    checkpointer.save(state)
  checkpointer.wait()
  assert checkpointer.steps == [2, 3]
  with pytest.raises(FileNotFoundError, match="step 1"):
    checkpointer.restore(state, step=1)
  checkpointer.close()


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1.0, 0.0])  # clipped, not reached, no clip
def test_the_update_is_optax_adamw_after_its_global_norm_clip(model_parts, max_grad_norm):
  """The trainer clips by one factor on each leaf (no gradient-sized temporaries); its step is optax's
  chain(clip_by_global_norm, adamw) on the mean gradient, and its grad_norm the mean gradient's norm."""
  import optax

  graphdef, params = model_parts
  trainer = trainer_for(graphdef, max_grad_norm=max_grad_norm)
  state = trainer.accumulate(trainer.init_state(params), make_batch(8, seed=4))
  mean = mean_gradient(state)
  new, metrics = trainer.apply(state)
  adamw = optax.adamw(optax.constant_schedule(1e-2))
  reference = optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw) if max_grad_norm else adamw
  host = jax.tree.map(np.asarray, params)
  updates, _ = reference.update(mean, reference.init(host), host)
  want = optax.apply_updates(host, updates)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert metrics["grad_norm"] == pytest.approx(float(optax.tree.norm(mean)), rel=1e-5)
  assert jax.tree.structure(new.opt_state) == jax.tree.structure(reference.init(host))  # checkpoints restore


def test_an_array_larger_than_the_write_bound_is_saved(model_parts, tmp_path, monkeypatch):
  """orbax refuses to write an array larger than its bound on bytes in flight (a 151,936 x 1,024 embedding is
  0.58 GiB against 0.25): the bound grows to the state's largest array."""
  from streamrl_jax.training import checkpoint

  monkeypatch.setattr(checkpoint, "WRITE_GB", 1e-6)  # a kilobyte: smaller than the embedding
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  state = trainer.init_state(params)
  checkpointer = Checkpointer(tmp_path, max_to_keep=1)
  checkpointer.save(state)
  restored, _ = checkpointer.restore(state)
  for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  checkpointer.close()


def test_bad_micro_batches_and_configs(model_parts):
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  state = trainer.init_state(params)
  batch = make_batch(4, seed=3)
  with pytest.raises(KeyError, match="advantages"):
    trainer.accumulate(state, {k: v for k, v in batch.items() if k != "advantages"})
  bad = dict(batch, loss_mask=np.ones_like(batch["loss_mask"]))
  with pytest.raises(ValueError, match="loss_mask\\[:, 0\\]"):
    trainer.accumulate(state, bad)
  with pytest.raises(ValueError, match="needs ref_params"):
    trainer_for(graphdef, ObjectiveConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="unknown schedule"):
    OptimizerConfig(schedule="step")


def test_micro_batcher_rechunks_to_the_same_gradient(model_parts):
  from streamrl_jax.training import MicroBatcher
  graphdef, params = model_parts
  trainer = trainer_for(graphdef, ObjectiveConfig(aggregation="seq_mean_token_mean"))
  parts = [make_batch(n, seed=20 + n, length=width) for n, width in [(3, 10), (9, 14), (2, 12), (7, 14)]]
  widen = lambda a: a if a.ndim == 1 else np.pad(a, ((0, 0), (0, 14 - a.shape[1])))  # noqa: E731
  full_batch = {k: np.concatenate([widen(p[k]) for p in parts]) for k in parts[0]}
  full = trainer.accumulate(trainer.init_state(params), full_batch)
  batcher = MicroBatcher(trainer, chunk_rows=8)
  streamed = trainer.init_state(params)
  for part in parts:
    streamed = batcher.add(streamed, part)
    assert batcher.pending_rows < 8
  assert batcher.pending_rows == 21 % 8
  streamed = batcher.flush(streamed)
  for a, b in zip(jax.tree.leaves(mean_gradient(streamed)), jax.tree.leaves(mean_gradient(full))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  batcher.rows_seen = 0
  with pytest.raises(ValueError, match="no rows"):
    batcher.finish(streamed)


def test_critic_value_loss_matches_numpy_and_accumulates(model_parts):
  from streamrl_jax.models import ValueModel
  graphdef, params = nnx.split(ValueModel(CONFIG, rngs=nnx.Rngs(1)))
  params["value_head"][...] = jax.random.normal(jax.random.key(2), (CONFIG.hidden_size,))
  mesh = mesh_from_devices(jax.devices()[4:8], MESH_SHAPE)
  trainer = Trainer(graphdef, OptimizerConfig(), ObjectiveConfig(), mesh, role="critic",
                    config=TrainerConfig())
  batch = make_batch(6, seed=9)
  rng = np.random.default_rng(9)
  batch = {k: batch[k] for k in ("tokens", "valid", "loss_mask")}
  batch.update(returns=rng.normal(size=(6, 14)).astype(np.float32), old_values=rng.normal(size=(6, 14)).astype(np.float32))
  state = trainer.accumulate(trainer.init_state(params), batch)
  values = np.asarray(nnx.merge(graphdef, params)(batch["tokens"], batch["valid"]))
  clipped = batch["old_values"] + np.clip(values - batch["old_values"], -0.2, 0.2)
  per_token = 0.25 * np.maximum((values - batch["returns"]) ** 2, (clipped - batch["returns"]) ** 2)
  expected = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
  np.testing.assert_allclose(float(state.sums["numerator"] / state.sums["denominator"]), expected, rtol=1e-5)
  streamed = trainer.init_state(params)
  for part in split_rows(batch, [2, 4]):
    streamed = trainer.accumulate(streamed, part)
  for a, b in zip(jax.tree.leaves(mean_gradient(streamed)), jax.tree.leaves(mean_gradient(state))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  with pytest.raises(KeyError, match="returns"):
    trainer.accumulate(streamed, {k: v for k, v in batch.items() if k != "returns"})


def test_the_callers_parameters_survive_training(model_parts):
  """The trainer's steps donate its state; the arrays the caller passed in (here already on the trainer's
  mesh, so placing them is a no-op) must stay alive and unchanged."""
  graphdef, params = model_parts
  trainer = trainer_for(graphdef)
  placed = trainer.place(params)
  before = jax.tree.map(np.asarray, placed)
  state = trainer.accumulate(trainer.init_state(placed), make_batch(8, seed=9))
  state, _ = trainer.apply(state)
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_a_steps_off_policy_metrics_split_compute_from_staleness_and_count_what_the_corrections_drop(model_parts):
  """Fresh rows whose sampler log-probabilities are the trainer's own, stale rows whose are off by a known shift: the
  compute part of the mismatch is ~0 and the staleness part numpy's; the masked and truncated shares are numpy's
  counts; the ratio's median is the histogram's (to a bin), streamed over two calls."""
  from streamrl_jax.training.corrections import HISTOGRAM_BINS, HISTOGRAM_EDGE
  graphdef, params = model_parts
  cfg = ObjectiveConfig(correction=("token_tis", "token_mask"), bands=CorrectionConfig(tis_cap=1.3, mask_low=0.0,
                                                                                       mask_high=1.6))
  trainer = trainer_for(graphdef, cfg)
  batch = make_batch(8, seed=4)
  del batch["old_logprobs"]
  own = np.asarray(token_logprobs(nnx.merge(graphdef, params)(batch["tokens"], batch["valid"]), batch["tokens"])[0])
  shift = np.random.default_rng(9).normal(0, 0.4, own.shape).astype(np.float32)
  stale = np.zeros_like(batch["loss_mask"])
  stale[4:] = batch["loss_mask"][4:]
  batch.update(logprobs=np.where(stale, own - shift, own).astype(np.float32), stale=stale)
  state = trainer.init_state(params)
  for part in split_rows(batch, [3, 5]):
    state = trainer.accumulate(state, part)
  _, metrics = trainer.apply(state)
  mask = batch["loss_mask"]
  d = shift[stale]  # log pi - log mu on the stale tokens
  assert metrics["logprob_mismatch_kl_compute"] < 1e-7
  np.testing.assert_allclose(metrics["logprob_mismatch_kl_staleness"], np.mean(np.expm1(d) - d), rtol=1e-3)
  ratio = np.exp(np.where(stale, shift, 0.0))[mask]
  np.testing.assert_allclose(metrics["correction_masked_token_frac"], np.mean(ratio > 1.6), rtol=1e-6)
  np.testing.assert_allclose(metrics["correction_truncated_token_frac"], np.mean((ratio > 1.3) & (ratio <= 1.6)),
                             rtol=1e-6)
  assert metrics["correction_masked_token_frac"] > 0 and metrics["correction_masked_sequence_frac"] == 0
  width = 2 * HISTOGRAM_EDGE / HISTOGRAM_BINS
  assert abs(np.log(metrics["is_ratio_q95"]) - np.log(np.quantile(ratio, 0.95, method="inverted_cdf"))) <= width
  assert metrics["is_ratio_q05"] <= metrics["is_ratio_q50"] <= metrics["is_ratio_q95"]
  fresh = trainer.accumulate(trainer.init_state(params), {**batch, "stale": np.zeros_like(stale)})
  _, metrics = trainer.apply(fresh)  # nothing stale: the staleness part is left out of the row, not NaN
  assert "logprob_mismatch_kl_staleness" not in metrics and "logprob_mismatch_kl_compute" in metrics
