"""The step graph (`workflow/`): every mistake refused in one line before anything is built, the built-in ops against
numpy, the flow's checks on what a stage writes, and the built-in graphs reproducing the formulas of the fixed step
they replaced."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.training import ObjectiveConfig, TrainerConfig, compute_advantages, kl_penalized_rewards
from streamrl_jax.workflow import GraphError, Stage, StepGraph, WorkflowConfig
from streamrl_jax.workflow.flow import StageError, StageFlow
from streamrl_jax.workflow.graphs import GENERATE, REWARD, UPDATE, advantage_stage
from streamrl_jax.workflow.ops import SAMPLE as SAMPLE_PORTS

HERE = "tests.test_workflow"


def _values(x):
  return np.asarray(x, np.float32)


def twice(rewards):
  return rewards * 2.0


def scaled(rewards, group_ids, *, factor):
  return rewards * factor


def _graph(name, *middle, update=UPDATE):
  return StepGraph(name, (GENERATE, REWARD, *middle, update))


CYCLE = _graph("cycle", Stage("a", f"{HERE}:twice", ("b_out:sample",), ("a_out:sample",)),
               Stage("b", f"{HERE}:twice", ("a_out:sample",), ("b_out:sample",)), advantage_stage())
MISSING = _graph("missing", Stage("advantage", "group_advantage", ("values:sample", "group_ids:group"),
                                  ("advantages:sample",)))
MISTYPED = _graph("mistyped", Stage("advantage", "group_advantage", ("rewards:token", "group_ids:group"),
                                    ("advantages:sample",)))
ACROSS = _graph("across", Stage("bonus", f"{HERE}:twice", ("rewards:sample",), ("bonus:sample",), pool="sampler"),
                advantage_stage("bonus"))
ON_SAMPLER = _graph("on_sampler", Stage("bonus", f"{HERE}:twice", ("rewards:sample",), ("bonus:sample",),
                                        pool="sampler"), advantage_stage())
NO_UPDATE = StepGraph("no_update", (GENERATE, REWARD, advantage_stage()))
ARITY = _graph("arity", Stage("bonus", f"{HERE}:twice", ("rewards:sample", "group_ids:group"), ("bonus:sample",)),
               advantage_stage("bonus"))
NOT_A_GRAPH = 3
UNKNOWN_OP = _graph("unknown_op", Stage("bonus", "nope", ("rewards:sample",), ("bonus:sample",)),
                    advantage_stage("bonus"))


@pytest.mark.parametrize("workflow, message", [
    (dict(graph="nope"), "WorkflowConfig.graph: unknown graph 'nope'"),
    (dict(graph=f"{HERE}:CYCLE"), r"stages \['a', 'b'\] form a cycle"),
    (dict(graph=f"{HERE}:MISSING"), "stage 'advantage' reads 'values', which no stage writes"),
    (dict(graph=f"{HERE}:MISTYPED"), "stage 'advantage' reads 'rewards' as token, but stage 'reward' writes it as sample"),
    (dict(graph=f"{HERE}:ACROSS"), "stage 'advantage' reads 'bonus' from pool 'sampler'"),
    (dict(graph=f"{HERE}:ON_SAMPLER"), "stage 'bonus': the sampler runs its own programs only"),
    (dict(graph=f"{HERE}:NO_UPDATE"), "needs exactly one stage of op 'policy_update'"),
    (dict(graph=f"{HERE}:ARITY"), r"stage 'bonus': op 'tests.test_workflow:twice'\(rewards\) cannot take inputs"),
    (dict(graph=f"{HERE}:NOT_A_GRAPH"), "is a int, not a StepGraph"),
    (dict(graph=f"{HERE}:ABSENT"), "tests.test_workflow has no 'ABSENT'"),
    (dict(bind=("advantage=judge",)), "stage 'advantage' is bound to pool 'judge', which has no devices"),
    (dict(bind=("advantage=judge",), pools=("judge=0",)), "pool 'judge', which has no devices"),
    (dict(bind=("generate=trainer",)), "op 'generate' is the sampler's own program; bind it to pool 'sampler'"),
    (dict(bind=("nope=trainer",)), "WorkflowConfig.bind: graph 'grpo' has no stage 'nope'"),
    (dict(graph=f"{HERE}:UNKNOWN_OP"), "stage 'bonus': unknown stage op 'nope'"),
    (dict(pools=("judge=1",)), "WorkflowConfig.pools: pool 'judge' has no stage bound to it"),
    (dict(graph="kl_reference", pools=("p=1",), bind=("reference=p",)), "the frozen reference is the trainer's own"),
    (dict(graph="distill"), "stage 'teacher' scores with the teacher model: set WorkflowConfig.teacher"),
    (dict(graph="judge"), "stage 'judge' scores with the judge model: set WorkflowConfig.judge"),
])
def test_a_graph_that_cannot_run_is_refused_in_one_line_naming_the_stage(workflow, message):
  with pytest.raises(GraphError, match=message) as err:
    PipelineConfig(workflow=WorkflowConfig(**workflow))
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("pools, message", [(("trainer=2",), "not 'name=devices' or 'name=HOST:PORT' with a new pool"),
                                            (("t=two",), "not 'name=devices'")])
def test_a_malformed_pool_is_refused_naming_the_key(pools, message):
  with pytest.raises(GraphError, match=f"WorkflowConfig.pools: .*{message}"):
    WorkflowConfig(pools=pools)


def test_a_role_programs_ports_are_its_roles():
  graph = StepGraph("ports", (Stage("generate", "generate", outputs=SAMPLE_PORTS + ("extra:token",), pool="sampler"),
                              REWARD, advantage_stage(), UPDATE))
  with pytest.raises(GraphError, match="op 'generate' is the sampler's own program, whose ports are fixed"):
    _order_checked(graph)


def _order_checked(graph):
  from streamrl_jax.workflow import config
  for stage in _order(graph):
    config._check_call(stage, config._stage_op(stage))


@pytest.mark.parametrize("arm, message", [
    (dict(advantage="dr_grpo"), "arm 'a': advantage 'dr_grpo', but WorkflowConfig.graph='rloo' fixes the estimator"),
    (dict(advantage="grpo"), "fixes the estimator to 'rloo'")])
def test_an_arm_cannot_pick_an_estimator_its_graph_fixes(arm, message):
  from streamrl_jax.arms.config import ArmConfig, ArmsConfig
  with pytest.raises(ValueError, match=message):
    PipelineConfig(workflow=WorkflowConfig(graph="rloo"), arms=ArmsConfig(followers=(ArmConfig("a", **arm),)))
  PipelineConfig(workflow=WorkflowConfig(graph="rloo"), arms=ArmsConfig(followers=(ArmConfig("a", advantage="rloo"),)))


def test_arms_run_the_leads_graph_so_their_kl_settings_and_models_must_fit_it():
  from streamrl_jax.arms.config import ArmConfig, ArmsConfig
  in_reward = ArmConfig("a", objective=ObjectiveConfig(kl_coef=0.1, kl_in_reward=True))
  with pytest.raises(ValueError, match="arm 'a': ObjectiveConfig.kl_in_reward=True .* every arm runs the lead's graph"):
    PipelineConfig(arms=ArmsConfig(followers=(in_reward,)))
  with pytest.raises(ValueError, match="ArmsConfig.followers: .*'distill' scores with a model of its own"):
    PipelineConfig(workflow=WorkflowConfig(graph="distill", teacher="t"), arms=ArmsConfig(followers=(ArmConfig("a"),)))


def test_the_kl_settings_must_say_what_the_graph_does():
  in_reward = TrainerConfig(objective=ObjectiveConfig(kl_coef=0.1, kl_in_reward=True))
  with pytest.raises(ValueError, match="kl_in_reward=True: the KL in the reward is a stage of the graph 'kl_reference'"):
    PipelineConfig(trainer=in_reward)
  with pytest.raises(ValueError, match="graph='kl_reference' scores with the frozen reference: set .*kl_coef > 0"):
    PipelineConfig(workflow=WorkflowConfig(graph="kl_reference"))
  in_loss = TrainerConfig(objective=ObjectiveConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="graph='kl_reference' puts the KL to the reference in the reward"):
    PipelineConfig(trainer=in_loss, workflow=WorkflowConfig(graph="kl_reference"))
  PipelineConfig(trainer=in_reward, workflow=WorkflowConfig(graph="kl_reference"))


def test_built_in_graphs_order_their_stages_and_fix_their_estimator():
  orders = {g: [s.name for s in WorkflowConfig(graph=g, teacher="t", judge="j").order()]
            for g in ("grpo", "rloo", "kl_reference", "distill", "judge")}
  assert orders["grpo"] == orders["rloo"] == ["generate", "reward", "advantage", "update"]
  assert orders["kl_reference"] == ["generate", "reward", "reference", "kl_penalty", "advantage", "update"]
  assert orders["distill"] == ["generate", "reward", "teacher", "advantage", "update"]
  assert orders["judge"] == ["generate", "reward", "judge", "advantage", "update"]
  assert WorkflowConfig(graph="rloo").estimator == "rloo"
  assert PipelineConfig(workflow=WorkflowConfig(advantage="dr_grpo")).shape.advantage == "dr_grpo"
  reordered = StepGraph("late", tuple(reversed(WorkflowConfig().step_graph().stages)))
  assert [s.name for s in WorkflowConfig().order()] == [s.name for s in _order(reordered)]


def _order(graph):
  from streamrl_jax.workflow.graph import check
  from streamrl_jax.workflow.ops import role_pools
  return check(graph, {"sampler": 1, "trainer": 1}, role_pools())


def _shard_fields(rows=8, length=10, seed=0):
  rng = np.random.default_rng(seed)
  loss_mask = np.zeros((rows, length), bool)
  loss_mask[:, 4:] = rng.random((rows, length - 4)) < 0.8
  return dict(tokens=rng.integers(0, 30, (rows, length)), valid=np.ones((rows, length), bool), loss_mask=loss_mask,
              logprobs=_values(-rng.random((rows, length)) * 3 * loss_mask), group_ids=np.repeat(np.arange(rows // 4), 4),
              completion_lengths=_values(loss_mask.sum(axis=1)), rewards=_values(rng.random(rows)))


def _flow(workflow, models=None, objective=ObjectiveConfig()):
  stages = tuple(s for s in workflow.order() if s.pool == "trainer")
  return StageFlow(stages, dict(estimator=workflow.estimator, objective=objective), models)


@pytest.mark.parametrize("graph, advantage", [("grpo", "grpo"), ("grpo", "dr_grpo"), ("rloo", "grpo"),
                                              ("grpo", "reinforce_pp")])
def test_group_graphs_give_the_fixed_steps_advantages(graph, advantage):
  fields = _shard_fields()
  out = _flow(WorkflowConfig(graph=graph, advantage=advantage)).run(fields)
  estimator = "rloo" if graph == "rloo" else advantage
  np.testing.assert_array_equal(out["advantages"], compute_advantages(estimator, fields["rewards"], fields["group_ids"]))
  rewards, groups = fields["rewards"].astype(np.float64), fields["group_ids"]
  if estimator == "grpo":  # against numpy: (r - mean) / (std + eps) per group
    mean = np.array([rewards[groups == g].mean() for g in groups])
    std = np.array([rewards[groups == g].std() for g in groups])
    np.testing.assert_allclose(out["advantages"], (rewards - mean) / (std + 1e-6), rtol=1e-5)


def test_kl_reference_subtracts_the_summed_kl_to_the_reference_from_the_reward():
  fields = _shard_fields(seed=3)
  reference = _values(fields["logprobs"] - 0.3 * fields["loss_mask"])
  objective = ObjectiveConfig(kl_coef=0.2, kl_in_reward=True, kl_estimator="k1")
  out = _flow(WorkflowConfig(graph="kl_reference"), {"reference": lambda t, v: reference}, objective).run(fields)
  penalized = fields["rewards"] - 0.2 * (0.3 * fields["loss_mask"]).sum(axis=1)  # k1: log mu - log ref = 0.3
  np.testing.assert_allclose(out["penalized_rewards"], penalized, rtol=1e-5)
  expected = compute_advantages("grpo", kl_penalized_rewards(fields["rewards"], fields["logprobs"], reference,
                                                             fields["loss_mask"], 0.2, "k1"), fields["group_ids"])
  np.testing.assert_allclose(out["advantages"], expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 1000))
def test_distill_advantage_is_the_teachers_log_prob_minus_the_samplers_on_loss_tokens(seed):
  fields = _shard_fields(seed=seed)
  teacher = _values(np.random.default_rng(seed + 1).normal(size=fields["tokens"].shape))
  flow = _flow(WorkflowConfig(graph="distill", teacher="t"), {"teacher": lambda t, v: teacher})
  out = flow.run(fields)
  mask = fields["loss_mask"]
  np.testing.assert_allclose(out["advantages"], np.where(mask, teacher - fields["logprobs"], 0), rtol=1e-6)
  assert out["advantages"].shape == mask.shape and np.all(out["advantages"][~mask] == 0)
  total, count = flow.sums(out)["advantages"]
  assert count == mask.sum() and total == pytest.approx(float(np.sum((teacher - fields["logprobs"])[mask])), rel=1e-4)


def raises(rewards):
  raise RuntimeError("the user's bug")


def nan(rewards):
  return rewards * np.nan


def too_short(rewards):
  return rewards[:-1]


def as_bool(rewards):
  return rewards > 0.5


@pytest.mark.parametrize("fn, message", [
    ("raises", "stage 'bonus' .*raised RuntimeError: the user's bug"),
    ("nan", "stage 'bonus' wrote 'bonus' with values that are not finite numbers"),
    ("too_short", r"stage 'bonus' wrote 'bonus' of shape \(7,\); a sample field is \(8,\)"),
    ("as_bool", "stage 'bonus' wrote 'bonus' of dtype bool; a sample field is numbers")])
def test_what_a_users_stage_writes_is_checked_before_it_reaches_the_weights(fn, message):
  graph = _graph("users", Stage("bonus", f"{HERE}:{fn}", ("rewards:sample",), ("bonus:sample",)),
                 advantage_stage("bonus"))
  stages = _order(graph)
  with pytest.raises(StageError, match=message):
    StageFlow(tuple(s for s in stages if s.pool == "trainer"), dict(estimator="grpo")).run(_shard_fields())


def test_a_users_stage_takes_its_params_and_the_flows_keywords():
  graph = _graph("params", Stage("bonus", f"{HERE}:scaled", ("rewards:sample", "group_ids:group"), ("bonus:sample",),
                                 params=(("factor", 3.0),)), advantage_stage("bonus"))
  fields = _shard_fields()
  out = StageFlow(tuple(s for s in _order(graph) if s.pool == "trainer"), dict(estimator="dr_grpo")).run(fields)
  np.testing.assert_allclose(out["bonus"], fields["rewards"] * 3.0, rtol=1e-6)
  np.testing.assert_allclose(out["advantages"], compute_advantages("dr_grpo", fields["rewards"] * 3.0,
                                                                   fields["group_ids"]), rtol=1e-5)


def test_the_old_advantage_key_names_where_it_went():
  from streamrl_jax.settings import MOVED_KEYS
  assert MOVED_KEYS["PipelineConfig.advantage"] == "WorkflowConfig.advantage"
  assert dataclasses.replace(PipelineConfig(), workflow=WorkflowConfig(advantage="rloo")).shape.advantage == "rloo"


def test_a_pool_wanting_more_devices_than_are_spare_is_refused_by_name():
  import jax
  from streamrl_jax.workflow.pools import pool_meshes
  workflow = WorkflowConfig(graph="distill", teacher="t", pools=("teacher=3",), bind=("teacher=teacher",))
  with pytest.raises(GraphError, match="pool 'teacher' wants 3 devices; 2 are left beyond the meshes"):
    pool_meshes(workflow, jax.devices()[:2])
  meshes = pool_meshes(workflow, jax.devices()[5:8])
  assert [d.id for d in meshes["teacher"].devices.flat] == [5, 6, 7]


def test_the_example_algorithm_is_a_few_functions_and_a_graph_under_60_lines():
  from pathlib import Path
  folder = Path(__file__).resolve().parent.parent / "examples" / "own_algorithm"
  code = [line for f in ("own_algorithm.py", "own_algorithm.gin") for line in (folder / f).read_text().splitlines()
          if line.strip() and not line.strip().startswith("#")]
  assert len(code) < 60, len(code)
  workflow = WorkflowConfig(graph=str(folder / "own_algorithm.py") + ":GRAPH")
  fields = _shard_fields()
  fields["rewards"] = _values([0.0, 1.0, 1.0, 0.5, 2.0, 2.0, 2.0, 2.0])
  fields["completion_lengths"] = _values([9, 30, 9, 9, 9, 9, 9, 9])  # one over the budget of 24
  out = _flow(workflow).run(fields)
  np.testing.assert_allclose(out["shaped"], fields["rewards"] - _values([0, 6 * 0.02, 0, 0, 0, 0, 0, 0]), rtol=1e-6)
  fields["completion_lengths"][1] = 9
  out = _flow(workflow).run(fields)
  # the first group's rewards 0, 1, 1, 0.5 rank 1, 3.5, 3.5, 2 (ties averaged), mapped by (2 r - 5) / 3 to [-1, 1];
  # the second group's four equal rewards all rank 2.5: advantage 0
  np.testing.assert_allclose(out["advantages"], [-1.0, 2 / 3, 2 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0], rtol=1e-6, atol=1e-7)


def test_a_trainer_of_several_processes_runs_every_graph_on_its_mesh_and_refuses_other_pools(monkeypatch):
  from pathlib import Path
  from streamrl_jax.pipeline.trainer import program
  monkeypatch.setattr(program.jax, "process_count", lambda: 2)
  example = Path(__file__).resolve().parent.parent / "examples" / "own_algorithm" / "own_algorithm.py"
  program._check(PipelineConfig(workflow=WorkflowConfig(graph=f"{example}:GRAPH")))
  program._check(PipelineConfig(workflow=WorkflowConfig(graph="rloo")))
  program._check(PipelineConfig(workflow=WorkflowConfig(graph="distill", teacher="t")))  # tests/test_stage_processes
  with pytest.raises(ValueError, match="WorkflowConfig.pools: a pool of the run's own .* 2 processes"):
    program._check(PipelineConfig(workflow=WorkflowConfig(graph="judge", judge="j", pools=("j=1",), bind=("judge=j",))))
  with pytest.raises(ValueError, match="a scorer program serves a trainer of one process"):
    program._check(PipelineConfig(workflow=WorkflowConfig(graph="judge", judge="j", pools=("j=127.0.0.1:5",),
                                                          bind=("judge=j",))))
