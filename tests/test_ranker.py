"""The output-length ranker: loss and metrics against numpy by hand, shard_map inference against the plain
model, learning on arithmetic, background training, checkpointing; the scheduling controller."""

import time

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from streamrl_jax.models import CharTokenizer
from streamrl_jax.scheduling import (OnlineRanker, RankerConfig, SchedulingConfig, dispatch_requests,
                                     engine_slots, lengths_from_scores, pairwise_ranking_loss,
                                     ranking_metrics, recall_at)
from streamrl_jax.scheduling.ranker import encode_prompts
from streamrl_jax.tasks import ArithmeticTask

TOKENIZER = CharTokenizer()
SMALL = RankerConfig(max_prompt_length=24, embed_dim=16, hidden_dim=32, batch_size=32)


def arithmetic_pairs(n, seed):
  """(prompt tokens, worked-solution length): the length follows from the operands' digits and carries."""
  rng, task = np.random.default_rng(seed), ArithmeticTask(max_digits=8)
  pairs = [task.sample(rng) for _ in range(n)]
  return [TOKENIZER.encode(p) for p, _ in pairs], [len(s) + 1 for _, s in pairs]


def test_pairwise_loss_equals_numpy():
  rng = np.random.default_rng(0)
  scores, lengths = rng.normal(size=7).astype(np.float32), np.array([3, 9, 9, 1, 4, 20, 2], np.float32)
  valid = np.array([1, 1, 1, 1, 1, 1, 0], bool)
  total, pairs = 0.0, 0
  for i in range(7):
    for j in range(7):
      if valid[i] and valid[j] and lengths[i] > lengths[j]:
        total += np.log1p(np.exp(scores[j] - scores[i]))
        pairs += 1
  np.testing.assert_allclose(float(pairwise_ranking_loss(scores, lengths, valid)), total / pairs, rtol=1e-6)


def test_recall_spearman_and_length_mapping_by_hand():
  actual = [10, 50, 20, 40, 30, 5, 60, 1, 2, 3]
  assert recall_at(actual, actual, 0.2) == 1.0
  assert recall_at([-a for a in actual], actual, 0.2) == 0.0
  assert recall_at([0, 9, 0, 0, 0, 0, 0, 0, 8, 0], actual, 0.2) == 0.5  # predicted {1, 8}, true {6, 1}
  m = ranking_metrics(actual, actual)
  assert m == {"recall_top20": 1.0, "recall_top10": 1.0, "recall_top5": 1.0, "spearman": pytest.approx(1.0)}
  assert ranking_metrics([-a for a in actual], actual)["spearman"] == pytest.approx(-1.0)
  with pytest.raises(ValueError, match="two equal-length"):
    ranking_metrics([1.0], [2.0])
  # ranks 3, 1, 2 of 3 -> quantiles 5/6, 1/6, 1/2 of [10, 20, 30] (linear interpolation)
  np.testing.assert_allclose(lengths_from_scores([0.7, -2.0, 0.1], [10, 20, 30], 5), [26.6667, 13.3333, 20.0],
                             rtol=1e-4)
  np.testing.assert_array_equal(lengths_from_scores([0.7, -2.0], [], 5), [5.0, 5.0])


def test_sharded_inference_equals_the_plain_model():
  mesh = Mesh(np.asarray(jax.devices()).reshape(8), ("data",))
  ranker = OnlineRanker(SMALL, mesh)
  prompts, _ = arithmetic_pairs(11, seed=1)  # 11 rows -> bucket of 16, two per device
  tokens, mask = encode_prompts(prompts, SMALL)
  plain = nnx.merge(ranker.graphdef, ranker.state_arrays()["state"].params)(tokens, mask)
  np.testing.assert_allclose(ranker.scores(prompts), np.asarray(plain), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    ranker.scores([[3, 4], []])
  with pytest.raises(ValueError, match="3 prompts but 2 lengths"):
    ranker.observe(prompts[:3], [1, 2])
  with pytest.raises(ValueError, match="batch_size must be >= 2"):
    RankerConfig(batch_size=1)
  with pytest.raises(ValueError, match="RankerConfig.embed_dim must be > 0"):
    RankerConfig(embed_dim=0)


def test_ranker_learns_arithmetic_lengths_online():
  """Observed in rounds as the pipeline does: each round is scored before the ranker sees it."""
  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(4), ("data",))
  ranker = OnlineRanker(SMALL, mesh)
  first = None
  for round_ in range(8):
    prompts, lengths = arithmetic_pairs(128, seed=100 + round_)
    metrics = ranking_metrics(ranker.scores(prompts), lengths)
    first = first or metrics
    ranker.observe(prompts, lengths)
    ranker.train(16)
  held_out, lengths = arithmetic_pairs(256, seed=999)
  metrics = ranking_metrics(ranker.scores(held_out), lengths)
  assert first["recall_top20"] < 0.5 and metrics["recall_top20"] >= 0.8 and metrics["spearman"] > 0.8
  predicted = ranker.predict_lengths(held_out, default=10)
  assert np.corrcoef(predicted, lengths)[0, 1] > 0.8  # mapped onto the history's lengths


def test_ranker_keeps_up_when_lengths_drift():
  """Lengths that flip (the longest prompts now answered shortest) are learnt from the recent history."""
  config = RankerConfig(max_prompt_length=24, embed_dim=16, hidden_dim=32, batch_size=32, history=256)
  ranker = OnlineRanker(config)
  for round_ in range(4):
    prompts, lengths = arithmetic_pairs(128, seed=200 + round_)
    ranker.observe(prompts, lengths)
    ranker.train(16)
  held_out, lengths = arithmetic_pairs(256, seed=998)
  flipped = [100 - n for n in lengths]
  assert ranking_metrics(ranker.scores(held_out), flipped)["spearman"] < -0.5  # it learnt the old relation
  for round_ in range(6):
    prompts, lengths = arithmetic_pairs(128, seed=300 + round_)
    ranker.observe(prompts, [100 - n for n in lengths])
    ranker.train(16)
  metrics = ranking_metrics(ranker.scores(held_out), flipped)
  assert metrics["recall_top20"] >= 0.8 and metrics["spearman"] > 0.8


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=2, max_size=60, unique=True), st.floats(0.01, 0.99))
def test_recall_is_one_for_any_order_preserving_prediction(actual, fraction):
  predicted = [3.0 * a + 7.0 for a in actual]
  assert recall_at(predicted, actual, fraction) == 1.0
  assert 0.0 <= recall_at(list(reversed(predicted)), actual, fraction) <= 1.0
  assert ranking_metrics(predicted, actual)["spearman"] == pytest.approx(1.0)


def test_background_training_and_checkpoint_round_trip():
  ranker = OnlineRanker(SMALL)
  ranker.start()
  prompts, lengths = arithmetic_pairs(64, seed=3)
  ranker.observe(prompts, lengths)
  deadline = time.monotonic() + 60
  while ranker.counters["train_steps"] < SMALL.steps_per_round and time.monotonic() < deadline:
    time.sleep(0.01)
  ranker.stop()
  assert ranker.counters["train_steps"] >= SMALL.steps_per_round and np.isfinite(ranker.counters["last_loss"])
  saved = jax.tree.map(np.asarray, ranker.state_arrays())
  assert saved["tokens"].shape == (SMALL.history, SMALL.max_prompt_length) and int(saved["count"]) == 64
  fresh = OnlineRanker(SMALL)
  fresh.load_state_arrays(saved)
  np.testing.assert_array_equal(fresh.history_lengths, ranker.history_lengths)
  np.testing.assert_allclose(fresh.scores(prompts), ranker.scores(prompts), rtol=1e-6)


def test_scheduling_config_errors():
  for alpha in (0.0, 1.0, -0.1, 1.5):
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
      SchedulingConfig(alpha=alpha)
  with pytest.raises(ValueError, match="ptl_curve is empty"):
    SchedulingConfig(ptl_curve=())
  with pytest.raises(ValueError, match="batch sizes must be >= 1"):
    SchedulingConfig(ptl_curve=((0, 0.01),))
  with pytest.raises(ValueError, match="policy='lpt'"):
    SchedulingConfig(policy="lpt")
  with pytest.raises(ValueError, match=r"instances \(3\) <= max_instances \(2\)"):
    SchedulingConfig(instances=3, max_instances=2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(1, 500), min_size=1, max_size=40), st.integers(1, 4), st.sampled_from(["fifo", "skew_aware"]))
def test_dispatch_sends_every_request_to_exactly_one_live_instance(predicted, instances, policy):
  ids = [3, 5, 8, 9][:instances]
  config = SchedulingConfig(policy=policy, instances=instances)
  dispatch = dispatch_requests(config, predicted, [10, 20, 40], ids, num_slots=8, seed=1)
  assert len(dispatch.instance_of) == len(predicted) and set(dispatch.instance_of) <= set(ids)
  assert sorted(r for order in dispatch.plan.assignment for r in order) == list(range(len(predicted)))
  assert set(dispatch.slot_limits) == set(ids) and all(1 <= b <= 8 for b in dispatch.slot_limits.values())


def test_skew_aware_dispatch_sends_the_predicted_longest_to_the_long_instances():
  """History P90 200, P50 10; CPU curve. One long instance: 4 long at batch 4, 0.0067 * 200 = 1.34 s; two:
  2 each at batch 2, 0.0056 * 200 = 1.12 s, while the 16 short ones on the third take 2 * 0.0083 * 10 s."""
  predicted = [10.0] * 16 + [200.0] * 4
  config = SchedulingConfig(policy="skew_aware", instances=3, alpha=0.2)
  dispatch = dispatch_requests(config, predicted, [10] * 50 + [200] * 10, [4, 6, 7], num_slots=8)
  assert dispatch.plan.long_instances == 2
  assert dispatch.plan.assignment == ((16, 18), (17, 19), tuple(range(16)))
  assert dispatch.slot_limits == {4: 2, 6: 2, 7: 8}
  assert dispatch.instance_of == (7,) * 16 + (4, 6, 4, 6)


def test_engine_slots_round_a_planned_batch_up_to_a_power_of_two():
  assert [engine_slots(b, 32) for b in (1, 2, 3, 13, 16, 17, 32)] == [1, 2, 4, 16, 16, 32, 32]
  assert engine_slots(40, 48) == 48  # capped by the configured slots
  with pytest.raises(ValueError, match="planned batch must be >= 1"):
    engine_slots(0, 32)


def test_elastic_target_by_hand():
  config = SchedulingConfig(instances=2, max_instances=4, min_instances=1, elastic=True, hysteresis=0.0)
  assert config.instance_target(2, gen_s=10.0, train_s=2.0) == 3  # lagging by 8 s > 10/3 saved
  assert config.instance_target(4, gen_s=10.0, train_s=2.0) == 4  # no spare instance
  assert config.instance_target(2, gen_s=1.0, train_s=5.0) == 1  # 5 - (1 + 1) > 0: one fewer still keeps up
  assert config.instance_target(1, gen_s=1.0, train_s=5.0) == 1  # the floor
  assert config.instance_target(2, gen_s=4.0, train_s=3.0) == 2  # 1 s behind < 4/3 saved: keep
  assert SchedulingConfig(instances=2, max_instances=4).instance_target(2, 10.0, 2.0) == 2  # not elastic
