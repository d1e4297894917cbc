"""The built-in step graphs, and a graph by name or by the user's import path.

Every graph generates on the sampler's pool (the sample's fields: `SAMPLE`) and updates the policy on the trainer's;
what lies between is the algorithm. `grpo` is the step every run took before graphs (its advantage stage's estimator
is `WorkflowConfig.advantage`), `rloo` fixes it to leave-one-out, `kl_reference` subtracts the KL to a frozen
reference from the reward, `distill` trains on a teacher's per-token log-probabilities (on-policy distillation), `judge`
on a second model's verdict on each sample (the rule reward is still scored and logged), `ppo` on per-token advantages
by GAE from a critic that learns beside the policy (`workflow.critic`)."""

from __future__ import annotations

from streamrl_jax.registry import Registry
from streamrl_jax.rewards.functions import load_attribute
from streamrl_jax.workflow.graph import GraphError, Stage, StepGraph
from streamrl_jax.workflow.ops import OPS, registered_or_loaded

GENERATE = Stage("generate", "generate", outputs=OPS.get("generate").outputs, pool="sampler")
REWARD = Stage("reward", "rule_reward", OPS.get("rule_reward").inputs, OPS.get("rule_reward").outputs, pool="sampler")
UPDATE = Stage("update", "policy_update", OPS.get("policy_update").inputs)
GRAPHS = Registry("graph")


def advantage_stage(rewards: str = "rewards", estimator: str = "") -> Stage:
  """A group-relative advantage of `rewards` (`estimator`, else the run's `WorkflowConfig.advantage`)."""
  return Stage("advantage", "group_advantage", (f"{rewards}:sample", "group_ids:group"), ("advantages:sample",),
               params=(("estimator", estimator),) if estimator else ())


def _register(graph: StepGraph) -> StepGraph:
  return GRAPHS.register(graph.name)(graph)


GRPO = _register(StepGraph("grpo", (GENERATE, REWARD, advantage_stage(), UPDATE)))
RLOO = _register(StepGraph("rloo", (GENERATE, REWARD, advantage_stage(estimator="rloo"), UPDATE)))
KL_REFERENCE = _register(StepGraph("kl_reference", (
    GENERATE, REWARD,
    Stage("reference", "reference_logprobs", ("tokens:ids", "valid:mask"), ("reference_logprobs:token",)),
    Stage("kl_penalty", "kl_penalty", ("rewards:sample", "logprobs:token", "reference_logprobs:token",
                                       "loss_mask:mask"), ("penalized_rewards:sample",)),
    advantage_stage("penalized_rewards"), UPDATE)))
DISTILL = _register(StepGraph("distill", (
    GENERATE, REWARD,
    Stage("teacher", "teacher_logprobs", ("tokens:ids", "valid:mask"), ("teacher_logprobs:token",)),
    Stage("advantage", "reverse_kl", ("logprobs:token", "teacher_logprobs:token", "loss_mask:mask"),
          ("advantages:token",)),
    UPDATE)))
JUDGE = _register(StepGraph("judge", (
    GENERATE, REWARD,
    Stage("judge", "judge_reward", ("tokens:ids", "valid:mask"), ("judge_rewards:sample",)),
    advantage_stage("judge_rewards"), UPDATE)))
CRITIC_BATCH = ("tokens:ids", "valid:mask", "loss_mask:mask", "values:token", "returns:token")
PPO = _register(StepGraph("ppo", (
    GENERATE, REWARD,
    Stage("values", "critic_values", ("tokens:ids", "valid:mask"), ("values:token",)),
    Stage("gae", "gae", ("rewards:sample", "values:token", "loss_mask:mask"), ("advantages:token", "returns:token"),
          params=(("gamma", 1.0), ("lam", 1.0))),
    Stage("critic", "critic_update", CRITIC_BATCH),
    UPDATE)))


def find_graph(name: str) -> StepGraph:
  """The built-in graph `name`, or the `StepGraph` at the user's import path ('module:name' or 'file.py:name')."""
  graph = registered_or_loaded(GRAPHS, name, lambda path: load_attribute(path, "WorkflowConfig.graph"),
                               "WorkflowConfig.graph: ")
  if not isinstance(graph, StepGraph):
    raise GraphError(f"WorkflowConfig.graph {name!r} is a {type(graph).__name__}, not a StepGraph")
  return graph
