"""The trainer's step intake as a pure function, without devices: hand-worked cases, then properties over arrival
orders (duplicates, early, refused and stale shards, dynamic sampling)."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.pipeline.trainer.step_intake import IntakeRules, IntakeState, backfilled, begin, take
from streamrl_jax.streaming import SampleShard
from tests.wire_samples import group_shard

RULES = IntakeRules(steps=4, prompts_per_step=2, backfill_per_step=0, group_size=2, max_lag=1,
                    dynamic_sampling=False, reward_names=("task",))


def group(step: int, g: int, indices=(0, 1), version: int | None = None, rewards=(0.0, 1.0)) -> SampleShard:
  """Samples `indices` of group `g` of `step`, sampled by weights `version` (default: the step's own)."""
  shard = group_shard([5, 6], step=step, group=g).take(list(indices))
  n = len(indices)
  version = step if version is None else version
  return dataclasses.replace(shard, first_versions=np.full(n, version), last_versions=np.full(n, version),
                             rewards=np.asarray([rewards[i] for i in indices], np.float32))


def keys(shard):
  return sorted(shard.keys()) if shard is not None else []


def test_a_step_takes_each_planned_sample_once_and_holds_a_later_steps_shard():
  state, held = begin(IntakeState(), RULES, 1)  # step 1's groups: 2 and 3
  assert held == [] and state.needed == 4
  state, taken = take(state, RULES, group(1, 2, (0,)))
  assert keys(taken.train) == [(1, 2, 0)] and state.needed == 3
  state, taken = take(state, RULES, group(1, 2))  # sample 0 again, beside sample 1
  assert keys(taken.train) == [(1, 2, 1)] and taken.duplicates == 1 and state.needed == 2
  later = group(2, 4)
  state, taken = take(state, RULES, later)
  assert taken.held and taken.train is None and state.needed == 2
  state, taken = take(state, RULES, group(1, 9))  # not in step 1's plan
  assert "which its plan does not hold (groups 2..3" in taken.refused and state.needed == 2
  state, taken = take(state, RULES, group(0, 0))  # late: step 0 is over
  assert taken.duplicates == 2 and taken.train is None
  state, taken = take(state, RULES, group(1, 3))
  assert keys(taken.train) == [(1, 3, 0), (1, 3, 1)] and state.needed == 0
  state, held = begin(state, RULES, 2)
  assert held == [later] and state.early == () and state.taken == frozenset() and state.needed == 4


def test_a_group_with_a_token_past_the_bound_is_handed_back_and_its_fresh_copy_trained():
  state, _ = begin(IntakeState(), RULES, 3)  # max_lag 1: version 2 or newer
  state, taken = take(state, RULES, SampleShard.concat([group(3, 6, version=1), group(3, 7, version=2)]))
  assert taken.regenerate == (6,) and keys(taken.train) == [(3, 7, 0), (3, 7, 1)] and state.needed == 2
  state, taken = take(state, RULES, group(3, 6, version=3))
  assert keys(taken.train) == [(3, 6, 0), (3, 6, 1)] and state.needed == 0 and taken.duplicates == 0


def test_dynamic_sampling_filters_equal_reward_groups_and_a_grant_widens_the_step():
  rules = dataclasses.replace(RULES, backfill_per_step=2, dynamic_sampling=True)  # step 0: 0, 1; backfill 2, 3
  state, _ = begin(IntakeState(), rules, 0)
  state, taken = take(state, rules, SampleShard.concat([group(0, 0, rewards=(1.0, 1.0)), group(0, 1)]))
  assert taken.filtered == (0,) and keys(taken.train) == [(0, 1, 0), (0, 1, 1)] and keys(taken.arrived) == [
      (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)] and state.needed == 0
  state = backfilled(state, rules, 1)
  assert state.needed == 2
  state, taken = take(state, rules, group(0, 2))
  assert keys(taken.train) == [(0, 2, 0), (0, 2, 1)] and state.needed == 0


@st.composite
def arrivals(draw):
  """Step 1's samples (groups 2 and 3) in any order and cut, some twice, some first from too old weights, among
  shards of step 2, of step 0 and outside the plan."""
  pieces = []
  for g in (2, 3):
    cut = draw(st.sampled_from([[(0, 1)], [(0,), (1,)], [(1,), (0,)]]))
    stale = draw(st.booleans())
    for indices in cut:
      if stale:
        pieces.append(("stale", group(1, g, indices, version=-1)))
      pieces.append(("fresh", group(1, g, indices)))
  for _ in range(draw(st.integers(0, 3))):
    kind = draw(st.sampled_from(["again", "early", "late", "foreign"]))
    shard = {"again": lambda: draw(st.sampled_from([p for k, p in pieces if k == "fresh"])),
             "early": lambda: group(2, draw(st.sampled_from([4, 5]))), "late": lambda: group(0, 0),
             "foreign": lambda: group(1, 8)}[kind]()
    pieces.insert(draw(st.integers(0, len(pieces))), (kind, shard))
  order = draw(st.permutations(range(len(pieces))))
  return [pieces[i] for i in order]


@settings(max_examples=60, deadline=None)
@given(arrivals())
def test_every_sample_of_the_step_is_trained_once_whatever_the_order(arriving):
  state, _ = begin(IntakeState(), RULES, 1)
  trained, regenerated = [], []
  for kind, shard in arriving:
    before = state
    state, taken = take(state, RULES, shard)
    trained += keys(taken.train)
    regenerated += taken.regenerate
    if kind == "foreign":
      assert taken.refused and state == before
    if kind == "early":
      assert taken.held and state.early[-1] == (2, shard)
    if kind == "stale":  # leased again, unless its fresh copy came first (then it is a duplicate)
      assert taken.train is None
      assert taken.regenerate == (int(shard.group_ids[0]),) or taken.duplicates == shard.num_samples
  assert sorted(trained) == [(1, g, i) for g in (2, 3) for i in (0, 1)]  # each once, nothing else
  assert state.needed == 0 and state.taken == set(trained)
  early = [shard for kind, shard in arriving if kind == "early"]
  assert begin(state, RULES, 2)[1] == early  # held for step 2, in the order they came
