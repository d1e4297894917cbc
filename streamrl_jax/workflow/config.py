"""The step's graph of a run (`WorkflowConfig`): which graph, the advantage estimator its stages take, the run's own
pools of devices and which stage runs on which, and the frozen models its stages score with."""

from __future__ import annotations

import dataclasses
import inspect

from streamrl_jax.training import ADVANTAGES
from streamrl_jax.training.advantages import SEQUENCE_LEVEL
from streamrl_jax.training.objectives import ValueLossConfig
from streamrl_jax.workflow.graph import ROLE_POOLS, GraphError, Stage, StepGraph, check
from streamrl_jax.workflow.graphs import find_graph
from streamrl_jax.workflow.ops import FLOW_KEYWORDS, Op, resolve_op, role_pools


@dataclasses.dataclass(frozen=True)
class WorkflowConfig:
  """A run's step graph (`workflow/`): stages bound to pools, checked before anything is built."""

  # the step's graph: a built-in one (grpo, rloo, kl_reference, distill, judge, ppo) or the user's StepGraph at
  # 'module:name' or 'path/to/file.py:name'
  graph: str = "grpo"
  # the estimator of an advantage stage that names none (the grpo graph's): grpo, dr_grpo, rloo or reinforce_pp
  advantage: str = "grpo"
  # pools of the run's own, 'name=devices': devices of the trainer's program that its mesh leaves (in one process:
  # that neither mesh uses); a teacher or judge stage bound to one scores there; 'name=HOST:PORT': a scorer program
  # (`streamrl scorer --stage STAGE`) that scores the one teacher or judge stage bound to it
  pools: tuple[str, ...] = ()
  bind: tuple[str, ...] = ()  # stages moved to another pool, 'stage=pool' (pools: sampler, trainer, or an own one)
  # the frozen teacher model of a distill stage: a catalog name, a .gguf, a Hugging Face directory or Hub id (its
  # tokenizer must be the policy's)
  teacher: str = ""
  judge: str = ""  # the judge graph's model, as `teacher` (the policy's vocabulary)
  # put after each sample for the judge: the reward is its probability of ' yes' against ' no' after it
  judge_question: str = "\nIs the answer above right? Answer yes or no:"
  # the ppo graph's critic's learning rate (0: the policy's, OptimizerConfig.learning_rate); a critic's head starts at
  # zero and usually learns faster than the policy
  critic_learning_rate: float = 0.0
  value_loss: ValueLossConfig = ValueLossConfig()  # the ppo graph's critic's clipped value loss

  def __post_init__(self):
    ADVANTAGES.get(self.advantage)
    if self.critic_learning_rate < 0:
      raise GraphError(f"WorkflowConfig.critic_learning_rate must be >= 0 (0: the policy's), got "
                       f"{self.critic_learning_rate}")
    if self.advantage not in SEQUENCE_LEVEL:
      raise GraphError(f"WorkflowConfig.advantage={self.advantage!r} is per token, from a critic's values: the "
                       f"'ppo' graph's gae stage computes it (WorkflowConfig.graph='ppo'); advantage, the estimator of "
                       f"group advantages, is one of {list(SEQUENCE_LEVEL)}")
    self.own_pools()
    self.bindings()

  def own_pools(self) -> dict[str, int]:
    """The run's own pools of devices: name -> devices."""
    return {name: int(where) for name, where in self._pools().items() if where.isdigit()}

  def remote_pools(self) -> dict[str, str]:
    """The run's scorer programs: pool name -> 'HOST:PORT'."""
    return {name: where for name, where in self._pools().items() if not where.isdigit()}

  def _pools(self) -> dict[str, str]:
    out = {}
    for text in self.pools:
      name, _, where = text.partition("=")
      host, _, port = where.rpartition(":")
      if not name.isidentifier() or name in ROLE_POOLS or name in out or not (
          where.isdigit() or (host and port.isdigit())):
        raise GraphError(f"WorkflowConfig.pools: {text!r} is not 'name=devices' or 'name=HOST:PORT' with a new pool "
                         f"name (not {list(ROLE_POOLS)})")
      out[name] = where
    return out

  def bindings(self) -> dict[str, str]:
    """stage name -> the pool `bind` moves it to."""
    out = {}
    for text in self.bind:
      stage, _, pool = text.partition("=")
      if not stage or not pool or stage in out:
        raise GraphError(f"WorkflowConfig.bind: {text!r} is not 'stage=pool' (one entry a stage)")
      out[stage] = pool
    return out

  def step_graph(self) -> StepGraph:
    """The graph, its stages on the pools `bind` names."""
    graph = find_graph(self.graph)
    try:
      return graph.bound(self.bindings())
    except GraphError as err:
      raise GraphError(f"WorkflowConfig.bind: {err}") from None

  def order(self) -> tuple[Stage, ...]:
    """The graph's stages in the order they run, each stage's op checked to take its ports and params; raises
    GraphError naming the first problem."""
    graph = self.step_graph()
    remote = self.remote_pools()
    order = check(graph, {**{p: 1 for p in ROLE_POOLS}, **self.own_pools(), **{p: 1 for p in remote}}, role_pools())
    for stage in order:
      op = _stage_op(stage)
      _check_call(stage, op)
      if stage.pool == "sampler" and op.fn is not None:
        raise GraphError(f"stage {stage.name!r}: the sampler runs its own programs only (generate, rule_reward); "
                         f"bind it to 'trainer' or a pool of the run's own")
      if op.model in ("teacher", "judge") and not {"teacher": self.teacher, "judge": self.judge}[op.model]:
        raise GraphError(f"stage {stage.name!r} scores with the {op.model} model: set WorkflowConfig.{op.model}")
      if op.model == "reference" and stage.pool != "trainer":
        raise GraphError(f"stage {stage.name!r}: the frozen reference is the trainer's own, on its mesh; bind it "
                         f"to 'trainer', not {stage.pool!r}")
    for model in {resolve_op(s.op).model for s in order} - {""}:  # one model of each kind, on one pool
      where = {s.name: s.pool for s in order if resolve_op(s.op).model == model}
      if len(set(where.values())) > 1:
        raise GraphError(f"stages {sorted(where)} score with one {model} model: bind them to one pool, not {where}")
    for pool, address in remote.items():
      held = [s for s in order if s.pool == pool]
      if len(held) > 1 or any(resolve_op(s.op).model not in ("teacher", "judge") for s in held):
        raise GraphError(f"WorkflowConfig.pools: pool {pool!r} is a scorer program ({address}): it serves one teacher "
                         f"or judge stage, not {[s.name for s in held]}")
    idle = sorted(set(self._pools()) - {s.pool for s in order})
    if idle:
      raise GraphError(f"WorkflowConfig.pools: pool {idle[0]!r} has no stage bound to it (WorkflowConfig.bind)")
    return order

  @property
  def estimator(self) -> str:
    """The advantage estimator the run's group advantages use: the one its graph fixes, else `advantage`."""
    return self.fixed_estimator or self.advantage

  @property
  def fixed_estimator(self) -> str:
    """The estimator the graph's advantage stage names ('' where it takes the run's)."""
    fixed = [dict(s.params).get("estimator") for s in self.step_graph().stages if s.op == "group_advantage"]
    return next((f for f in fixed if f), "")

  def models(self) -> set[str]:
    """The frozen models the graph's stages score with."""
    return {resolve_op(s.op).model for s in self.step_graph().stages} - {""}


def _stage_op(stage: Stage) -> Op:
  try:
    return resolve_op(stage.op)
  except GraphError as err:
    raise GraphError(f"stage {stage.name!r}: {err}") from None


def _check_call(stage: Stage, op: Op) -> None:
  """The op of `stage` can be called with its inputs and params; a role's program has the ports its role gives."""
  if op.fn is None:
    if (stage.inputs, stage.outputs) != (op.inputs, op.outputs):
      raise GraphError(f"stage {stage.name!r}: op {stage.op!r} is the {op.role}'s own program, whose ports are fixed: "
                       f"inputs {list(op.inputs)}, outputs {list(op.outputs)}")
    return
  try:
    signature = inspect.signature(op.fn)
  except (TypeError, ValueError):
    return  # a builtin: its call will tell
  given = FLOW_KEYWORDS if op.model else tuple(k for k in FLOW_KEYWORDS if k != "model")
  keywords = {k: None for k in given if k in signature.parameters and k not in dict(stage.params)}
  try:
    signature.bind(*stage.inputs, **keywords, **dict(stage.params))
  except TypeError as err:
    raise GraphError(f"stage {stage.name!r}: op {stage.op!r}{signature} cannot take inputs {list(stage.input_fields())}"
                     f" and params {dict(stage.params)}: {err}") from None
