"""The controller's parts on their own, without threads: the roster, the leases, the step plans, the weight trees;
and the trainer's side of the controller (`TrainerControl`) on process 0 and on the others."""

import dataclasses

import pytest

from streamrl_jax.messages import (Backfill, BadMessage, Lease, LeaseRequest, Published, Regenerate, Register,
                                   SamplerWaitQuery, StepReport, StepSummary, StepSummaryRequest, StepTrained)
from streamrl_jax.models import CharTokenizer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.pipeline.controller.leases import Leases
from streamrl_jax.pipeline.controller.plans import StepPlans
from streamrl_jax.pipeline.controller.roster import Member, Roster, check_registration
from streamrl_jax.pipeline.controller.timeline import Timeline
from streamrl_jax.pipeline.controller.weight_trees import WeightTrees
from streamrl_jax.pipeline.trainer.control import FollowerControl, TrainerControl
from streamrl_jax.scheduling import SchedulingConfig
from streamrl_jax.tasks import ArithmeticTask
from streamrl_jax.pipeline.parts import controller_setup

CONFIG = PipelineConfig(mode="stream", steps=3, prompts_per_step=4, group_size=2, max_new_tokens=8)
FILTERED = dataclasses.replace(CONFIG, controller=dataclasses.replace(CONFIG.controller, dynamic_sampling=True,
                                                                      backfill_limit=3))  # backfill ids of step 0: 4, 5, 6


class Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def lease(step: int, group_ids) -> Lease:
  return Lease(lease_id=-1, step=step, group_ids=tuple(group_ids), prompts=tuple(f"p{g}" for g in group_ids),
               predicted_lengths=(), length_quantiles=(), min_version=step, instances=1)


def report(sampler_id: int, given: Lease, generation_s: float = 1.0, instances: int = 1) -> StepReport:
  return StepReport(sampler_id, given.lease_id, given.step, generation_s, tuple(3.0 for _ in given.prompts), 0.5,
                    len(given.prompts) * CONFIG.group_size, instances, ())


# ---- the roster ----------------------------------------------------------------------------------
def test_the_roster_expires_the_silent_sampler_and_remembers_it_lost():
  clock, timeline = Clock(), Timeline()
  roster = Roster(SchedulingConfig(), timeline, lease_timeout_s=5.0, clock=clock)
  a, b = roster.add("a"), roster.add("b", site="x", relay="10.0.0.2:5")
  clock.now += 4.0
  roster.heard(b)
  assert roster.silent() == []  # a: 4 s, not more than 5
  clock.now += 2.0
  assert roster.silent() == [a] and roster.silent_s() == 2.0  # a: 6 s; b: 2 s
  assert roster.remove(a, lost=True) == "a"
  assert a not in roster and roster.is_lost(a) and roster.name_of(a) == "a" and len(roster) == 1
  roster.heard(a)  # a lost sampler's voice changes nothing
  assert roster.members() == [Member(b, "b", "x", "10.0.0.2:5")] and roster.relay_of(a) == ""
  clock.now += 60.0
  roster.all_heard()  # this process was paused: nobody is silent
  assert roster.silent() == []
  roster.remove(b, lost=False)
  assert roster.silent_s() is None and not roster.is_lost(b)
  counters = timeline.counters
  assert (counters["registered"], counters["samplers_lost"], counters["samplers_left"]) == (2, 1, 1)


def test_the_roster_sets_the_instance_target_per_sampler_process():
  roster = Roster(SchedulingConfig(instances=2), Timeline(), lease_timeout_s=5.0, clock=Clock())
  assert roster.target_instances == 2
  roster.retarget(StepSummary(9.0, sampler_instances=6, sampler_processes=2, sampler_rss_mb=0.0, ranker={}), 1.0)
  assert roster.target_instances == 3  # not elastic: what each of the 2 processes ran
  assert not roster.finished
  roster.finish()
  assert roster.finished


def test_registration_is_refused_for_other_settings_or_a_relay_that_is_no_address():
  check_registration({"PipelineConfig.seed": "1"}, Register("s", {"PipelineConfig.seed": "1"}, relay="10.0.0.1:5"))
  with pytest.raises(BadMessage, match="2 settings differ, first 'PipelineConfig.mode'"):
    check_registration({"PipelineConfig.seed": "1"}, Register("s", {"PipelineConfig.mode": "'async'"}))
  with pytest.raises(BadMessage, match="sampler 's': Register.relay"):
    check_registration({}, Register("s", {}, relay="nowhere"))


# ---- the leases ----------------------------------------------------------------------------------
def test_a_dropped_sampler_gives_back_only_the_leases_it_had_not_reported():
  timeline = Timeline()
  leases = Leases(timeline)
  first, second = leases.grant(7, lease(0, (0, 1)), 3), leases.grant(7, lease(0, (2,)), 3)
  other = leases.grant(8, lease(0, (3,)), 3)
  assert (first.lease_id, second.lease_id, other.lease_id, first.instances) == (0, 1, 2, 3)
  assert leases.held(7, 0, 0) == first and leases.held(8, 0, 0) is None and leases.held(7, 0, 1) is None
  leases.reported(7, 0)
  assert leases.open_groups(7) == {2}
  assert leases.take_back(7, lost=True) == [second]
  assert leases.held(7, 1, 0) is None and leases.held(7, 0, 0) == first  # a reported lease stays to its summary
  assert leases.take_back(7, lost=True) == [] and leases.open_groups(8) == {3}
  assert leases.foreign(7, 0, [0, 2, 3]) == [3]  # groups once leased to it are still its own
  leases.trained_below(1, live={8})  # step 0 trained: 7 (gone) is forgotten; 8 keeps nothing of step 0
  assert leases.foreign(7, 0, [0]) == [0] and leases.foreign(8, 0, [3]) == [3]
  leases.forget([0])
  assert leases.held(7, 0, 0) is None
  assert (timeline.counters["leases"], timeline.counters["re_leased_leases"]) == (3, 1)


def test_groups_leased_again_after_a_loss_are_announced_once_when_first_delivered():
  timeline = Timeline()
  leases = Leases(timeline)
  loss = (100.0, "a")
  leases.lost(0, (2, 3), loss)
  assert leases.first_deliveries(0, [1]) == []
  assert leases.first_deliveries(0, [2]) == [loss]
  assert leases.first_deliveries(0, [3]) == []  # the same loss, delivered already
  assert timeline.counters["re_leased_prompts"] == 2


# ---- the step plans ------------------------------------------------------------------------------
def make_plans(config=CONFIG) -> tuple[StepPlans, Leases, Timeline]:
  timeline = Timeline()
  plans = StepPlans(config.shape, config.scheduling, config.sampler.engine.num_slots, ArithmeticTask(max_digits=2),
                    CharTokenizer(), timeline, start_step=0)
  return plans, Leases(timeline), timeline


def test_a_step_opens_at_its_version_and_its_summary_is_taken_once():
  plans, leases, _ = make_plans()
  assert plans.next_lease(2, 1) is None  # nothing published
  plans.publish(0)
  given = [leases.grant(5, plans.next_lease(2, 1), 1), leases.grant(6, plans.next_lease(2, 1), 1)]
  assert [g.group_ids for g in given] == [(0, 1), (2, 3)] and plans.next_step == 1
  assert plans.next_lease(2, 1) is None  # step 1 needs version 1 (stream: on-policy)
  plans.report(given[0], report(5, given[0], generation_s=2.0, instances=2))
  assert not plans.summarised(0)
  plans.report(given[1], report(6, given[1], generation_s=3.0, instances=1))
  assert plans.summarised(0)
  summary, reported = plans.take(0)
  assert summary == StepSummary(3.0, sampler_instances=3, sampler_processes=2, sampler_rss_mb=0.0, ranker={})
  assert reported == [0, 1] and not plans.summarised(0)
  with pytest.raises(KeyError):
    plans.take(0)


def test_a_lease_handed_back_goes_first_cut_to_its_missing_groups():
  plans, leases, timeline = make_plans()
  plans.publish(0)
  given = leases.grant(5, plans.next_lease(1, 1), 1)
  assert given.group_ids == (0, 1, 2, 3)
  plans.delivered(0, {1: 4.0, 3: 6.0})
  assert plans.hand_back(given) == (0, 2)
  again = plans.next_lease(1, 1)
  assert again.group_ids == (0, 2) and again.prompts == (given.prompts[0], given.prompts[2])
  assert timeline.counters["groups_kept"] == 2


def test_a_lease_whose_groups_all_arrived_counts_as_reported_when_handed_back():
  plans, leases, _ = make_plans()
  plans.publish(0)
  first, second = leases.grant(5, plans.next_lease(2, 1), 1), leases.grant(6, plans.next_lease(2, 1), 1)
  plans.report(first, report(5, first))
  plans.delivered(0, {2: 4.0, 3: 4.0})
  assert plans.hand_back(second) == () and plans.summarised(0)  # summarised without the lost report
  assert plans.take(0)[0].sampler_processes == 1


def test_backfill_and_regeneration_lease_more_of_the_same_step():
  plans, leases, timeline = make_plans(FILTERED)
  plans.publish(0)
  planned = plans.next_lease(1, 1)
  assert plans.backfill(0, [0, 1], 1) == 2 and plans.backfill(0, [2, 3], 1) == 1 and plans.backfill(0, [0], 1) == 0
  backfilled = [plans.next_lease(1, 1), plans.next_lease(1, 1)]
  assert [b.group_ids for b in backfilled] == [(4, 5), (6,)]
  plans.regenerate(0, [1, 5], 1)
  regenerated = plans.next_lease(1, 1)
  assert regenerated.group_ids == (1, 5)
  assert regenerated.prompts == (planned.prompts[1], backfilled[0].prompts[1])  # the same prompts again
  assert [e["backfilled"] for e in timeline.events if e["event"] == "groups_filtered"] == [2, 1, 0]
  assert (timeline.counters["prompts_backfilled"], timeline.counters["groups_regenerated"]) == (3, 2)


# ---- the weight trees ----------------------------------------------------------------------------
def test_each_version_gets_its_tree_and_the_newest_four_are_kept():
  timeline = Timeline()
  trees = WeightTrees(timeline, site="a", fanout=2)
  members = [Member(0, "s0", "a", "10.0.0.1:5"), Member(1, "s1", "a", ""), Member(2, "s2", "a", "10.0.0.3:5"),
             Member(3, "s3", "b", ""), Member(4, "s4", "b", "10.0.0.5:5")]
  trees.plant(1, members)
  # site a: relays first, two a node (s0, s2 under the trainer, s1 under s0); site b: one copy to s4, s3 below it
  assert [trees.parent(1, i) for i in range(5)] == [None, 0, None, 4, None]
  assert trees.parent(1, 99) is None  # not in the tree: the trainer
  trees.plant(2, members[1:])  # s0 gone: the trainer has room for s2 and s1
  assert trees.parent(2, 1) is None and trees.parent(1, 1) == 0  # each version keeps its own tree
  for version in (3, 4, 5):
    trees.plant(version, members[1:])
  assert 1 not in trees and 2 in trees and 5 in trees
  drawn = [e for e in timeline.events if e["event"] == "broadcast_tree"]
  assert [e["unchanged"] for e in drawn] == [False, False, True, True, True]
  assert drawn[0]["parents"] == {"s0": None, "s2": None, "s1": "s0", "s4": None, "s3": "s4"}


def test_a_tree_without_relays_is_not_drawn():
  timeline = Timeline()
  WeightTrees(timeline, site="a").plant(1, [Member(0, "s0", "a", ""), Member(1, "s1", "a", "")])
  assert timeline.events == []


# ---- the trainer's side: TrainerControl ----------------------------------------------------------
def test_the_controller_and_the_follower_answer_the_same_protocol():
  controller = Controller(controller_setup(CONFIG), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0)
  follower = FollowerControl(FILTERED.shape)
  assert isinstance(controller, TrainerControl) and isinstance(follower, TrainerControl)
  assert follower.step_trained(StepTrained(0, 1.0)).metrics()["sampler_instances"] == 1
  assert follower.regenerate(Regenerate(0, (1,))) == follower.published(Published(1))
  # the controller's backfill rule (limit 3 a step), kept per step
  asked = [(0, (1, 2)), (0, (3, 4)), (0, (5,)), (1, (9,))]
  assert [follower.backfill(Backfill(step, filtered)).count for step, filtered in asked] == [2, 1, 0, 1]
  assert follower.sampler_wait(SamplerWaitQuery()).seconds == 0.0


def test_the_controller_hands_a_step_summary_out_once_and_retargets_from_it():
  config = dataclasses.replace(CONFIG, scheduling=SchedulingConfig(instances=1, max_instances=4, elastic=True))
  controller = Controller(controller_setup(config), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0)
  sampler = controller.register(Register("s", {})).sampler_id
  controller.published(Published(0))
  given = controller.lease(LeaseRequest(sampler, 0.0)).lease
  controller.report(report(sampler, given, generation_s=4.0))
  summary = controller.step_trained(StepTrained(0, 1.0))
  assert summary.generation_s == 4.0 and summary.metrics()["sampler_processes"] == 1
  assert config.scheduling.instance_target(1, 4.0, 1.0) == 2  # generation 4x training: one more instance
  controller.published(Published(1))
  assert controller.lease(LeaseRequest(sampler, 0.0)).lease.instances == 2
  with pytest.raises(TimeoutError, match="step 1 "):
    controller.take_step_summary(StepSummaryRequest(0, timeout_s=0.01))  # taken already
  assert controller.sampler_wait(SamplerWaitQuery()).seconds == 0.5


def test_messages_name_a_step_as_its_metrics_row_does():
  """Leases, shards and plans carry 0-based step indices; every message names index i as its metrics row does: i + 1."""
  from streamrl_jax.messages import BadShard
  from streamrl_jax.pipeline.controller.door import shard_groups
  from streamrl_jax.pipeline.events import describe_event
  from tests.wire_samples import group_shard

  assert describe_event(dict(event="sampler_joined", sampler="s1", next_step=0)).endswith("from step 1)")
  assert "(step 1) delivered by s1" in describe_event(dict(event="re_leased_delivered", sampler="s1", step=0,
                                                           lost_sampler="s0", since_lost_s=1.0))
  with pytest.raises(BadShard, match="group 7 of step 1 carries sample indices"):
    shard_groups(group_shard([5, 6], step=0), group_size=3)
  controller = Controller(controller_setup(CONFIG), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0)
  sampler = controller.register(Register("s", {})).sampler_id
  with pytest.raises(BadMessage, match="lease -1 of step 1, which it does not hold"):
    controller.report(report(sampler, lease(0, [0, 1])))
  with pytest.raises(TimeoutError, match="reports of step 1 did not arrive"):
    controller.take_step_summary(StepSummaryRequest(0, timeout_s=0.01))
