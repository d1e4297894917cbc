"""Pure scheduling policies: hand-worked cases and properties."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.scheduling import (elastic_decision, instance_latency, lpt_assign, lpt_order, ptl_at,
                                     random_dispatch, resource_split, skew_aware_dispatch)
from streamrl_jax.scheduling.policies import adaptive_steps, fixed_steps

CURVE = {1: 0.010, 4: 0.012, 16: 0.020}


def test_latency_model_by_hand():
  assert ptl_at(CURVE, 1) == 0.010 and ptl_at(CURVE, 10) == pytest.approx(0.016) and ptl_at(CURVE, 64) == 0.020
  assert instance_latency(CURVE, 4, 100.0, 10) == pytest.approx(0.012 * 100 * 3)
  assert instance_latency(CURVE, 4, 100.0, 0) == 0.0
  with pytest.raises(ValueError, match="empty latency curve"):
    ptl_at({}, 4)


def test_lpt_order_and_assignment_by_hand():
  assert lpt_order([3, 9, 1, 9]) == [1, 3, 0, 2]
  assert lpt_assign(range(5), [7, 5, 4, 3, 3], 2) == [[0, 3], [1, 2, 4]]  # loads 10 and 12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=7), st.integers(2, 3))
def test_lpt_makespan_within_four_thirds_of_optimum(work, machines):
  plan = lpt_assign(range(len(work)), work, machines)
  makespan = max(sum(work[i] for i in group) for group in plan)
  best = min(max(sum(w for w, m in zip(work, labels) if m == k) for k in range(machines))
             for labels in itertools.product(range(machines), repeat=len(work)))
  assert makespan <= 4 / 3 * best + 1e-9
  assert sorted(i for group in plan for i in group) == list(range(len(work)))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1, 5000), min_size=2, max_size=60), st.integers(2, 9), st.integers(1, 64),
       st.floats(0.05, 0.9))
def test_every_prompt_is_assigned_exactly_once(predicted, instances, max_batch, alpha):
  for plan in (skew_aware_dispatch(predicted, instances, max_batch, CURVE, alpha=alpha),
               random_dispatch(len(predicted), instances, max_batch, seed=1)):
    assert sorted(i for order in plan.assignment for i in order) == list(range(len(predicted)))
    assert len(plan.assignment) == instances and all(1 <= b <= max_batch for b in plan.batch_sizes)


def test_skew_aware_dispatch_by_hand():
  predicted = [100.0] * 8 + [1000.0, 900.0]  # a clear long tail of two prompts
  plan = skew_aware_dispatch(predicted, 3, 8, CURVE, alpha=0.2)
  assert plan.long_instances >= 1
  long_ids = {i for order in plan.assignment[:plan.long_instances] for i in order}
  assert long_ids == {8, 9}
  for order in plan.assignment:  # longest-first inside every instance
    assert [predicted[i] for i in order] == sorted((predicted[i] for i in order), reverse=True)
  # Long group: 2 prompts of mean 1000; short group: 8 prompts of 100. With batch b the long group takes
  # PTL(b) * 1000 * ceil(per / b); the plan's choice must not be worse than any other split, by the model.
  per_long = math.ceil(2 / plan.long_instances)
  long_time = instance_latency(CURVE, plan.batch_sizes[0], 990.0, per_long)
  assert long_time <= instance_latency(CURVE, 1, 990.0, 2) + 1e-9
  for bad in (0.0, 1.0):
    with pytest.raises(ValueError, match="alpha must be in"):
      skew_aware_dispatch(predicted, 3, 8, CURVE, alpha=bad)


def test_resource_split_by_hand_and_errors():
  gen = lambda s: 120.0 / s  # noqa: E731
  train = lambda t: 40.0 / t  # noqa: E731
  assert resource_split(8, gen, train) == (6, 2)  # 20 s against 20 s
  assert resource_split(16, gen, train, sampler_unit=4) == (12, 4)
  with pytest.raises(ValueError, match="cannot hold one sampler unit"):
    resource_split(3, gen, train, sampler_unit=2, trainer_unit=2)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 200), st.integers(1, 8), st.integers(1, 8), st.floats(1, 1e4), st.floats(1, 1e4))
def test_resource_split_never_exceeds_the_budget(total, su, tu, g, t):
  if total < su + tu:
    with pytest.raises(ValueError):
      resource_split(total, lambda s: g / s, lambda n: t / n, sampler_unit=su, trainer_unit=tu)
    return
  sampler, trainer = resource_split(total, lambda s: g / s, lambda n: t / n, sampler_unit=su, trainer_unit=tu)
  assert sampler + trainer <= total and sampler % su == 0 and trainer % tu == 0 and sampler >= su and trainer >= tu


def test_elastic_decision_with_hysteresis():
  assert elastic_decision(100.0, 60.0, saved_by_one_more=20.0, lost_by_one_fewer=30.0) == 1
  assert elastic_decision(100.0, 85.0, saved_by_one_more=20.0, lost_by_one_fewer=30.0) == 0
  assert elastic_decision(40.0, 100.0, saved_by_one_more=10.0, lost_by_one_fewer=20.0) == -1
  assert elastic_decision(70.0, 100.0, saved_by_one_more=10.0, lost_by_one_fewer=25.0) == 0  # would overshoot
  assert elastic_decision(100.0, 78.0, 20.0, 30.0, hysteresis=0.05) == 0  # 22 vs 20 + 5 margin


def test_longest_first_admission_by_hand():
  from types import SimpleNamespace

  from streamrl_jax.scheduling import longest_first_admission
  pending = [SimpleNamespace(predicted_length=v) for v in (10.0, None, 30.0, 20.0, None, 30.0)]
  assert longest_first_admission(pending) == [2, 5, 3, 0, 1, 4]


def test_scheduling_policies_are_registered_with_their_admission_and_ranker_need():
  from streamrl_jax.scheduling import (SCHEDULING_POLICIES, SchedulingConfig, fifo_order,
                                       longest_first_admission)

  assert SCHEDULING_POLICIES.names() == ["fifo", "skew_aware"]
  assert SchedulingConfig(policy="fifo").scheduling_policy.admission is fifo_order
  skew = SchedulingConfig(policy="skew_aware").scheduling_policy
  assert skew.admission is longest_first_admission and skew.needs_ranker
  assert not SCHEDULING_POLICIES.get("fifo").needs_ranker
  with pytest.raises(ValueError, match=r"SchedulingConfig.policy='lifo'; known: \['fifo', 'skew_aware'\]"):
    SchedulingConfig(policy="lifo")


def test_decode_steps_by_hand():
  options = EngineConfig(steps_per_sync=8).step_options
  assert options == (1, 2, 4, 8) and EngineConfig(steps_per_sync=6).step_options == (1, 2, 4, 6)
  assert adaptive_steps([30, 5], fresh=0, options=options) == 8  # the fewest round trips
  assert adaptive_steps([3, 2], fresh=0, options=options) == 4  # every row ends within 4 steps
  assert adaptive_steps([5, 0], fresh=0, options=options) == 8
  assert adaptive_steps([1, 0], fresh=0, options=options) == 1
  assert adaptive_steps([30, 30], fresh=2, options=options) == 1  # just admitted: first tokens out now
  assert adaptive_steps([30, 30], fresh=1, options=options) == 8
  assert fixed_steps([1, 1], fresh=2, options=options) == 8


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=16), st.integers(0, 16), st.integers(1, 40))
def test_decode_steps_is_an_option_and_never_makes_more_calls_than_steps_per_sync(remaining, fresh, most):
  options = EngineConfig(steps_per_sync=most).step_options
  fresh = min(fresh, len(remaining))
  steps = adaptive_steps(remaining, fresh=fresh, options=options)
  assert steps in options and options[-1] == most and list(options) == sorted(set(options))
  if fresh < len(remaining):  # a call takes every row as far as steps_per_sync would, or to its end
    assert steps >= min(most, max(remaining)) and (steps == most or steps < 2 * max(1, max(remaining)))
