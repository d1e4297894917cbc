"""The trainer program's flow of a step graph: the stages its pools run (the trainer's mesh, the run's own pools and
its scorer programs), with their models placed: the reference (the trainer's own), a teacher and a judge (or a scorer
program's), a critic."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models.activation_layout import ActivationLayout
from streamrl_jax.models.fused_attention import trainer_kernel
from streamrl_jax.training.call_loss import CallLoss
from streamrl_jax.training.config import TrainerConfig
from streamrl_jax.training.logprobs import Truncation
from streamrl_jax.workflow.config import WorkflowConfig
from streamrl_jax.workflow.critic import make_critic
from streamrl_jax.workflow.flow import StageFlow
from streamrl_jax.workflow.graph import GraphError, flow
from streamrl_jax.workflow.judge import load_judge
from streamrl_jax.workflow.remote import RemoteScorer
from streamrl_jax.workflow.ops import resolve_op
from streamrl_jax.workflow.teacher import load_teacher


def pool_meshes(workflow: WorkflowConfig, spare: list) -> dict:
  """A mesh for each of the run's own pools, cut from `spare` (devices no mesh of the program uses) in order."""
  meshes, taken = {}, 0
  for name, count in workflow.own_pools().items():
    if taken + count > len(spare):
      raise GraphError(f"WorkflowConfig.pools: pool {name!r} wants {count} devices; {len(spare) - taken} are left "
                       f"beyond the meshes")
    meshes[name] = mesh_from_devices(spare[taken:taken + count], MeshShape(count, 1, 1))
    taken += count
  return meshes


@dataclasses.dataclass(frozen=True)
class Student:
  """What the frozen models of a flow must match of the policy: its vocabulary and tokenizer, its compute dtype."""

  vocab_size: int
  compute_dtype: str
  longest: int  # the run's longest sample (prompt and new tokens): the width a frozen model's calls are
  tokenizer: object = None  # encodes the judge's question (None: no judge stage)
  policy: tuple = ()  # (model config, parameters) of the policy at the run's start: a critic's trunk starts as it
  seed: int = 0  # the run's: a critic's head and optimizer start from it


def trainer_flow(workflow: WorkflowConfig, trainer: TrainerConfig, estimator: str, scoring: tuple[float, Truncation],
                 meshes: Mapping[str, object], student: Student, reference: Callable | None,
                 scorer_tls=None) -> StageFlow:
  """The flow of the stages on the trainer's mesh and the run's own pools (`meshes`: pool -> its mesh, 'trainer'
  included, or the 'HOST:PORT' of a scorer program, reached with `scorer_tls`); `scoring`: the sampler's temperature
  and truncation; `reference`: the trainer's frozen reference's log-probs (None: it has none)."""
  stages = flow(workflow.order(), meshes)
  models = {}
  for stage in stages:
    model, where = resolve_op(stage.op).model, meshes[stage.pool]
    if not model or model in models:
      continue
    if model == "reference":
      if reference is None:
        raise GraphError(f"stage {stage.name!r} scores with the frozen reference: set ObjectiveConfig.kl_coef > 0")
      models["reference"] = reference
    elif model == "critic":  # its stages are on one pool (`WorkflowConfig.order`)
      models["critic"] = _critic(student, trainer, where, workflow)
    elif isinstance(where, str):  # a scorer program's
      models[model] = RemoteScorer(where, stage.name, model, student.vocab_size, scorer_tls)
    else:
      models[model] = frozen_model(model, workflow, trainer, scoring, student, where)
  return StageFlow(stages, dict(estimator=estimator, objective=trainer.objective), models)


def frozen_model(kind: str, workflow: WorkflowConfig, trainer: TrainerConfig, scoring: tuple[float, Truncation],
                 student: Student, mesh) -> Callable:
  """The frozen model of `kind` ('teacher' or 'judge', `workflow`'s) on `mesh`, scoring the policy's samples."""
  if kind == "teacher":
    loss = CallLoss(trainer.objective, trainer, scoring[0], truncation=scoring[1],  # laid out as the policy's calls
                    layout=ActivationLayout(mesh, trainer_kernel(trainer.attention, mesh)))
    return load_teacher(workflow.teacher, student.vocab_size, student.compute_dtype, mesh, loss, student.longest)
  if student.tokenizer is None:
    raise GraphError("a judge's question is encoded with the policy's tokenizer, which this trainer was not given")
  return load_judge(workflow.judge, workflow.judge_question, student, mesh)


def _critic(student: Student, trainer: TrainerConfig, mesh, workflow: WorkflowConfig):
  """The critic, trained as the policy (`trainer`) but at its own learning rate (`WorkflowConfig.critic_learning_rate`,
  0: the policy's) with the workflow's value loss."""
  learning_rate = workflow.critic_learning_rate
  if not student.policy:
    raise GraphError("a critic's trunk starts as the policy: this trainer was not given the policy's parameters")
  if learning_rate:
    trainer = dataclasses.replace(trainer, optimizer=dataclasses.replace(trainer.optimizer, learning_rate=learning_rate))
  return make_critic(*student.policy, trainer, mesh, student.longest, student.seed, workflow.value_loss)
