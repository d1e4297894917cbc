"""The fan-out to follower arms without jax: a feed that is full drops a whole step, a follower too far behind
skips, nothing is waited for on the lead's side, and every offered sample is trained or counted."""

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from streamrl_jax.arms.feed import ArmFeed, Fanout, FollowerSource
from streamrl_jax.messages import StepSkipped
from streamrl_jax.arm_files import arms_from_configs
from streamrl_jax.arms.config import ArmConfig, arm_advice, check_arm_names
from streamrl_jax.arms.config import ArmsConfig
from streamrl_jax.config_types import ConfigError
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.workflow import WorkflowConfig
from streamrl_jax.job.config import DemoModelConfig, JobConfig
from streamrl_jax.streaming import QueueClosed
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig
from tests.wire_samples import group_shard


def shard(step: int, group: int, size: int = 4):
  return group_shard([5] * size, step=step, group=group)


def test_a_full_feed_drops_the_whole_step_and_the_follower_skips_it():
  feed = ArmFeed(capacity=8)
  fanout = Fanout({"f": feed})
  source = FollowerSource(feed, max_lag=5, first_step=0)
  for group in range(2):
    fanout.offer(shard(0, group))  # 8 samples: full
  fanout.offer(shard(1, 10))  # refused: step 1 is dropped for this feed
  assert source.skip(0) is None
  got = [source.get(0.1), source.get(0.1)]
  assert [int(s.group_ids[0]) for s in got] == [0, 1]
  source.trained(0)
  fanout.offer(shard(1, 11))  # room now, but step 1 stays dropped: never half a step
  assert feed.stats()["depth"] == 0
  assert source.skip(1) == "the follower's feed was full"
  fanout.offer(shard(2, 20))
  assert source.skip(2) is None and int(source.get(0.1).group_ids[0]) == 20
  assert source.counters == dict(arm_steps_skipped=1, arm_samples_skipped=0)
  assert feed.stats()["refused_samples"] == 8 and feed.stats()["offered_samples"] == 20  # both step-1 shards


def test_a_step_dropped_while_the_follower_waits_for_it_ends_the_wait_and_counts_what_it_had():
  feed = ArmFeed(capacity=8)
  fanout = Fanout({"f": feed})
  source = FollowerSource(feed, max_lag=5, first_step=0)
  source.skip(0)
  fanout.offer(shard(0, 0))
  assert source.get(0.1).num_samples == 4  # handed to the follower, the step not complete
  for group in (1, 2, 3):
    fanout.offer(shard(0, group))  # the follower has not read: the third does not fit; step 0 dropped
  with pytest.raises(StepSkipped, match="step 1 skipped: the follower's feed was full"):
    source.get(0.1)
  assert source.counters == dict(arm_steps_skipped=1, arm_samples_skipped=4)
  source.skip(1)
  with pytest.raises(TimeoutError):
    source.get(0.05)  # step 0's two queued shards are thrown away on the way, counted
  assert source.counters["arm_samples_skipped"] == 12
  fanout.offer(shard(1, 5))
  assert int(source.get(0.1).group_ids[0]) == 5


def test_a_follower_more_than_max_lag_behind_skips_until_it_is_within_it():
  feed = ArmFeed(capacity=100)
  fanout = Fanout({"f": feed})
  source = FollowerSource(feed, max_lag=1, first_step=0)
  fanout.lead_trained(4)  # the lead trained steps 0..3
  assert [source.skip(step) is not None for step in range(5)] == [True, True, True, False, False]
  assert "3 steps behind the lead" in FollowerSource(feed, 2, 0).skip(1)
  resumed = FollowerSource(feed, max_lag=9, first_step=3)
  assert "starts at step 4" in resumed.skip(2) and resumed.skip(3) is None


def test_the_fanout_never_waits_and_a_closed_feed_ends_the_follower():
  feed = ArmFeed(capacity=4)
  fanout = Fanout({"f": feed})
  for step in range(50):  # nobody reads: every offer returns at once
    fanout.offer(shard(step, step))
  fanout.close()
  source = FollowerSource(feed, max_lag=100, first_step=0)
  source.skip(0)
  assert source.get(0.1).num_samples == 4
  source.trained(0)
  assert all(source.skip(step) == "the follower's feed was full" for step in range(1, 50))
  assert source.skip(50) is None
  with pytest.raises(QueueClosed):
    source.get(0.1)  # closed and drained: the stream ended
  held = ArmFeed(capacity=8)
  assert held.offer(shard(0, 0)) and held.offer(shard(0, 1))
  held.close(discard=True)  # a stop: what is queued is thrown away, counted
  assert held.stats()["discarded_samples"] == 8 and not held.offer(shard(0, 2))
  with pytest.raises(QueueClosed):
    held.get(0.1, step=0)
  with pytest.raises(TimeoutError):
    ArmFeed(4).get(0.01, step=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=60), st.integers(4, 24),
       st.integers(0, 3))
def test_every_offered_sample_is_trained_skipped_or_refused(events, capacity, max_lag):
  """Groups of 4 samples of steps 0..5 arrive step by step (the lead trained the steps before one as its first
  group arrives); the follower reads one shard whenever told to, keeping a later step's for it as the trainer
  does, and at the end reads the rest. Offered = trained + skipped + refused (+ what is still queued); a step
  trained got every group offered for it."""
  feed = ArmFeed(capacity)
  fanout = Fanout({"f": feed})
  source = FollowerSource(feed, max_lag, first_step=0)
  offered, trained, early = {}, {}, {}
  state = dict(step=0, got=0, begun=False)

  def begin() -> bool:
    """Begins the current step (False: it is skipped)."""
    if source.skip(state["step"]) is not None:
      early.pop(state["step"], None)  # counted by the source
      state["step"] += 1
      return False
    state.update(begun=True, got=early.pop(state["step"], 0))
    return True

  def read_one() -> bool:
    if not state["begun"]:
      begin()
      return True
    try:
      got = source.get(0.0)
    except StepSkipped:
      state.update(step=state["step"] + 1, got=0, begun=False)
      return True
    except (TimeoutError, QueueClosed):
      return False
    got_step = int(got.steps[0])
    if got_step == state["step"]:
      state["got"] += got.num_samples
    else:
      early[got_step] = early.get(got_step, 0) + got.num_samples
    return True

  lead = 0
  for group, (shard_step, read) in enumerate(sorted(events, key=lambda e: e[0])):
    if shard_step > lead:
      fanout.lead_trained(shard_step)
      lead = shard_step
    fanout.offer(shard(shard_step, group))
    offered[shard_step] = offered.get(shard_step, 0) + 4
    if read:
      read_one()
  fanout.close()
  while state["step"] <= 5:
    if state["begun"] and state["got"] == offered.get(state["step"], 0):
      trained[state["step"]] = state["got"]
      source.trained(state["step"])
      state.update(step=state["step"] + 1, got=0, begun=False)
    elif not read_one():
      break
  assert state["step"] == 6  # every step ended trained or skipped
  counted = sum(trained.values()) + source.counters["arm_samples_skipped"] + feed.stats()["refused_samples"]
  assert counted + feed.stats()["depth"] + sum(early.values()) == sum(offered.values())
  for step, n in trained.items():
    assert n == offered.get(step, 0) and step not in source.skipped
  assert source.counters["arm_steps_skipped"] == 6 - len(trained)


def test_arm_names_and_settings_are_checked():
  with pytest.raises(ValueError, match="two arms are named 'a'"):
    check_arm_names("lead", [ArmConfig("a"), ArmConfig("a")])
  with pytest.raises(ValueError, match="two arms are named 'lead'"):
    PipelineConfig(mode="stream", arms=ArmsConfig(followers=(ArmConfig("lead"),)))
  with pytest.raises(ValueError, match="arm name 'a b'"):
    ArmConfig("a b")
  with pytest.raises(ValueError, match="colocated"):
    PipelineConfig(mode="colocated", arms=ArmsConfig(followers=(ArmConfig("x"),)))
  uncorrected = ObjectiveConfig(objective="reinforce", correction="none")
  config = PipelineConfig(arms=ArmsConfig(followers=(ArmConfig("pg", objective=uncorrected),
                                ArmConfig("ok", objective=ObjectiveConfig(objective="reinforce")))))
  advice = arm_advice(config.arms)
  assert len(advice) == 1 and advice[0].startswith("arm 'pg': ObjectiveConfig.correction='none' with old_logprobs=")


def test_arm_files_may_change_only_their_trainer():
  lead, job = PipelineConfig(), JobConfig()
  rloo = dataclasses.replace(lead, workflow=WorkflowConfig(advantage="rloo"), trainer=dataclasses.replace(lead.trainer,
                                                                                 optimizer=OptimizerConfig(learning_rate=1e-3)))
  (arm,) = arms_from_configs(lead, job, [("rloo", rloo, job)])
  assert (arm.name, arm.advantage, arm.optimizer.learning_rate) == ("rloo", "rloo", 1e-3)
  with pytest.raises(ConfigError, match=r"arm 'x': PipelineConfig.group_size=8 differs from the lead's \(4\)"):
    arms_from_configs(lead, job, [("x", dataclasses.replace(lead, group_size=8), job)])
  with pytest.raises(ConfigError, match="two arms"):
    arms_from_configs(lead, job, [("x", lead, job), ("x", lead, job)])
  wide = dataclasses.replace(job, demo=DemoModelConfig(hidden_size=128))
  specs = lambda j: j.model_spec()  # noqa: E731
  with pytest.raises(ConfigError, match=r"arm 'w': .* differ in shape \(hidden_size 128 vs 64\)"):
    arms_from_configs(lead, job, [("w", lead, wide)], specs)

  class Other:
    vocab_size = job.model_spec()[1].vocab_size + 1

  other_tokenizer = lambda j: (job.model_spec()[0], Other() if j.model else job.model_spec()[1])  # noqa: E731
  with pytest.raises(ConfigError, match="arm 't': .* the tokenizers differ"):
    arms_from_configs(lead, job, [("t", lead, dataclasses.replace(job, model="other.gguf"))], other_tokenizer)
