"""Several updates a step (pipeline/trainer/updates.py): mini-batches of whole groups, epochs over the step, and the
old log-probabilities of the step's starting weights, against a schedule written out here (the surrogate in numpy,
its gradient by jax.grad, the update by optax), and through the pipeline."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.models import Transformer
from streamrl_jax.pipeline.trainer.updates import StepUpdates, check_updates, mini_batch_bounds, split_at_group
from streamrl_jax.training import MicroBatcher, ObjectiveConfig, TrainerConfig
from tests.trainer_setup import CONFIG, make_batch, trainer_for

CLIP = 0.05  # narrow: the later updates' ratios leave it
LR, EPS = 1e-2, 1e-3  # Adam's eps well above float noise in the gradient, so two ways to compute it update alike


def test_mini_batches_by_hand():
  assert mini_batch_bounds(8, 4) == (2, 4, 6, 8)
  assert mini_batch_bounds(5, 2) == (3, 5) and mini_batch_bounds(4, 1) == (4,)
  with pytest.raises(ValueError, match="mini_batches=5: a step of 4 groups"):
    mini_batch_bounds(4, 5)
  groups = np.array([3, 3, 5, 5, 7])
  assert split_at_group(groups, set(), 1) == 2  # group 3 fits, 5 waits for the next mini-batch
  assert split_at_group(groups, {3}, 1) == 4  # group 3 goes on; 5 is the one new group
  assert split_at_group(groups, {3}, 0) == 2 and split_at_group(groups, set(), 3) == 5


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.data())
def test_mini_batches_split_a_step_as_evenly_as_whole_groups_allow(groups, data):
  count = data.draw(st.integers(1, groups))
  sizes = np.diff((0,) + mini_batch_bounds(groups, count))
  assert len(sizes) == count and sizes.sum() == groups and sizes.min() >= 1 and sizes.max() - sizes.min() <= 1
  assert list(sizes) == sorted(sizes, reverse=True)


def test_several_updates_are_refused_where_they_are_not_built():
  config = TrainerConfig(mini_batches=2)
  check_updates(TrainerConfig(), 4, {"critic": object()})  # one update a step: anything goes
  with pytest.raises(ValueError, match="mini_batches=2, epochs=1: .* one process; this one has 2"):
    check_updates(config, 2, {})
  with pytest.raises(ValueError, match=r"learning stages \(critic\) update once a step"):
    check_updates(config, 1, {"critic": object()})
  with pytest.raises(ValueError, match="TrainerConfig.epochs must be >= 1, got 0"):
    TrainerConfig(epochs=0)


def _logp(graphdef, params, batch):
  """log pi of each token given the ones before it (column 0: 0), from the model's logits."""
  logits = nnx.merge(graphdef, params)(batch["tokens"], batch["valid"]).astype(jnp.float32)
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), batch["tokens"][:, 1:, None], -1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


def _surrogate(logp, old, batch, xp):
  """PPO's clipped surrogate, token mean over the loss tokens (numpy or jax.numpy)."""
  ratio = xp.exp(logp - old)
  adv = batch["advantages"][:, None]
  loss = -xp.minimum(ratio * adv, xp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv)
  return xp.sum(loss * batch["loss_mask"]) / xp.sum(batch["loss_mask"])


def _reference(graphdef, params, batch, schedule):
  """(the loss before each update, the gradient norm of each, the final parameters) of `schedule` (the rows of each
  update, in order), old log-probabilities those of `params`."""
  old = np.asarray(_logp(graphdef, params, batch))
  tx = optax.adamw(LR, eps=EPS, weight_decay=0.0)
  opt, losses, norms = tx.init(params), [], []
  for rows in schedule:
    part = {k: v[rows] for k, v in batch.items()}
    loss = lambda p: _surrogate(_logp(graphdef, p, part), old[rows], part, jnp)  # noqa: E731
    losses.append(float(_surrogate(np.asarray(_logp(graphdef, params, part), np.float64), old[rows], part, np)))
    grads = jax.grad(loss)(params)
    norms.append(float(optax.tree.norm(grads)))
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
  return losses, norms, params


@pytest.mark.parametrize("mini_batches, epochs", [(2, 2), (4, 1)])
def test_each_update_of_a_step_equals_the_schedule_written_out(mini_batches, epochs):
  """4 groups of 2 samples arrive in two shards (1 group, then 3) that a mini-batch's end cuts: mini-batches of whole
  groups, each updated once its groups are in, then the later passes; every ratio is to the step's starting weights."""
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  objective = ObjectiveConfig(correction="none", clip_low=CLIP, clip_high=CLIP)
  trainer = trainer_for(graphdef, objective, max_grad_norm=0.0, eps=EPS)
  batch = make_batch(8, seed=4)
  del batch["old_logprobs"]
  groups = np.repeat(np.arange(4), 2)
  updates = StepUpdates(trainer, MicroBatcher(trainer, chunk_rows=8), TrainerConfig(
      mini_batches=mini_batches, epochs=epochs, objective=objective), 4)
  state = trainer.init_state(params)
  waited = []
  updates.begin(state, lambda: waited.append(1) or 0.5)
  for rows in (slice(0, 2), slice(2, 8)):
    state = updates.add(state, {k: v[rows] for k, v in batch.items()}, groups[rows])
  state, record = updates.end(state)

  size = 8 // mini_batches
  schedule = [np.arange(i * size, (i + 1) * size) for i in range(mini_batches)] * epochs
  losses, norms, want = _reference(graphdef, jax.tree.map(np.asarray, params), batch, schedule)
  assert int(state.step) == len(schedule) and waited == [1] and record.waited_s == 0.5
  np.testing.assert_allclose([m["loss"] for m in record.metrics], losses, atol=1e-5)
  np.testing.assert_allclose([m["grad_norm"] for m in record.metrics], norms, rtol=1e-4)
  for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
  row = record.row()
  assert row["optimizer_updates"] == len(schedule) and row["clip_frac_first"] == 0 and row["clip_frac_last"] > 0


def test_the_sampler_as_old_policy_needs_no_copy_and_one_update_a_step_is_todays():
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  bypass = ObjectiveConfig(old_logprobs="sampler", correction="none")
  trainer = trainer_for(graphdef, bypass)
  updates = StepUpdates(trainer, MicroBatcher(trainer), TrainerConfig(epochs=2, objective=bypass), 4)
  updates.begin(trainer.init_state(params), lambda: 0.0)
  assert not updates.own_old and updates.start_params is None
  once = StepUpdates(trainer, MicroBatcher(trainer), TrainerConfig(), 4)
  assert not once.own_old and once.bounds == (4,)


def test_a_stream_run_makes_every_update_and_counts_them():
  """The in-process pipeline, stream mode: 2 mini-batches x 2 epochs a step, each row's `optimizer_updates` says 4;
  the first update of a step is on-policy (nothing clipped)."""
  from tests.pipeline_setup import BASE, run
  result = run("stream", steps=2, trainer=dataclasses.replace(BASE.trainer, mini_batches=2, epochs=2))
  assert [row["optimizer_updates"] for row in result.metrics] == [4.0, 4.0]
  assert all(row["clip_frac_first"] == 0 and row["clip_frac_last"] >= 0 for row in result.metrics)
