"""A step as a graph of stages (DistFlow): each stage reads typed fields of a sample and writes others, and runs on
a pool of devices; `check` refuses a graph that cannot run, in one line naming the stage, and orders it; `flow` is
the part of it one pool's worker runs.

A port is `"field:type"`; an input may accept several types (`"advantages:sample|token"`). Types: `ids` (token ids
[rows, T]), `mask` (booleans [rows, T]), `group` (ints [rows]), `sample` (floats [rows]), `token` (floats [rows, T])."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

TYPES = ("ids", "mask", "group", "sample", "token")
# What a sample carries from the sampler's pool to the trainer's (`streaming.sample_schema`; `completion_lengths`:
# its loss tokens, counted from the wire's mask): nothing else crosses
WIRE_FIELDS = ("tokens", "valid", "loss_mask", "logprobs", "group_ids", "completion_lengths", "rewards")
ROLE_POOLS = ("sampler", "trainer")  # the two meshes every run has; others are a run's own (`WorkflowConfig.pools`)


class GraphError(ValueError):
  """A graph that cannot run: one line naming the stage, field or pool."""


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage: `op` (a built-in op's name, or 'module:function' / 'file.py:function' of the user's) reads `inputs`
  and writes `outputs` (ports, "field:type"), on `pool`, with keyword `params` ((name, value) pairs)."""

  name: str
  op: str
  inputs: tuple[str, ...] = ()
  outputs: tuple[str, ...] = ()
  pool: str = "trainer"
  params: tuple[tuple[str, object], ...] = ()

  def input_fields(self) -> tuple[str, ...]:
    return tuple(port(p, self.name)[0] for p in self.inputs)

  def output_fields(self) -> tuple[str, ...]:
    return tuple(port(p, self.name)[0] for p in self.outputs)


@dataclasses.dataclass(frozen=True)
class StepGraph:
  """A step's stages, in any order (`check` orders them)."""

  name: str
  stages: tuple[Stage, ...]

  def stage(self, name: str) -> Stage:
    for s in self.stages:
      if s.name == name:
        return s
    raise GraphError(f"graph {self.name!r} has no stage {name!r}; its stages: {[s.name for s in self.stages]}")

  def bound(self, pools: Mapping[str, str]) -> StepGraph:
    """This graph with stages moved to other pools (`pools`: stage name -> pool)."""
    for name in pools:
      self.stage(name)
    return dataclasses.replace(self, stages=tuple(dataclasses.replace(s, pool=pools.get(s.name, s.pool))
                                                  for s in self.stages))


def port(text: str, stage: str) -> tuple[str, tuple[str, ...]]:
  """(field, its accepted types) of a port 'field:type|type'."""
  field, sep, types = text.partition(":")
  kinds = tuple(types.split("|")) if sep else ()
  if not field.isidentifier() or not kinds or any(k not in TYPES for k in kinds):
    raise GraphError(f"stage {stage!r}: port {text!r} is not 'field:type' with a type of {list(TYPES)}")
  return field, kinds


def check(graph: StepGraph, pools: Mapping[str, int], roles: Mapping[str, str]) -> tuple[Stage, ...]:
  """`graph`'s stages in an order that runs (each after the stages it reads from). `pools`: each pool's devices;
  `roles`: the ops that are a role's own program -> the pool that runs them (the sampler generates and scores its
  rewards, the trainer updates). Raises GraphError naming the first problem."""
  names = [s.name for s in graph.stages]
  for name in names:
    if names.count(name) > 1 or not name.isidentifier():
      raise GraphError(f"graph {graph.name!r}: stage name {name!r} is repeated or not an identifier")
  producers = _producers(graph)
  for stage in graph.stages:
    if pools.get(stage.pool, 0) < 1:
      raise GraphError(f"stage {stage.name!r} is bound to pool {stage.pool!r}, which has no devices (pools: "
                       f"{dict(pools)}; WorkflowConfig.pools adds one as 'name=devices')")
    if stage.op in roles and roles[stage.op] != stage.pool:
      raise GraphError(f"stage {stage.name!r}: op {stage.op!r} is the {roles[stage.op]}'s own program; bind it to "
                       f"pool {roles[stage.op]!r}, not {stage.pool!r}")
    for text in stage.inputs:
      _check_input(stage, text, producers)
  for op in ("generate", "policy_update"):
    if [s.op for s in graph.stages].count(op) != 1:
      raise GraphError(f"graph {graph.name!r} needs exactly one stage of op {op!r}")
  return _ordered(graph, producers)


def _producers(graph: StepGraph) -> dict[str, tuple[Stage, str]]:
  """field -> (the stage that writes it, its type)."""
  out: dict[str, tuple[Stage, str]] = {}
  for stage in graph.stages:
    for text in stage.outputs:
      field, kinds = port(text, stage.name)
      if len(kinds) != 1:
        raise GraphError(f"stage {stage.name!r}: output {text!r} must have one type")
      if field in out:
        raise GraphError(f"field {field!r} is written by stages {out[field][0].name!r} and {stage.name!r}")
      out[field] = (stage, kinds[0])
  return out


def _check_input(stage: Stage, text: str, producers) -> None:
  field, kinds = port(text, stage.name)
  if field not in producers:
    raise GraphError(f"stage {stage.name!r} reads {field!r}, which no stage writes")
  source, kind = producers[field]
  if kind not in kinds:
    raise GraphError(f"stage {stage.name!r} reads {field!r} as {'|'.join(kinds)}, but stage {source.name!r} writes "
                     f"it as {kind}")
  if source.pool != stage.pool and "sampler" in (source.pool, stage.pool) and field not in WIRE_FIELDS:
    raise GraphError(f"stage {stage.name!r} reads {field!r} from pool {source.pool!r}: between the sampler and the "
                     f"trainer a sample carries only {list(WIRE_FIELDS)}; bind {source.name!r} to {stage.pool!r}")


def _ordered(graph: StepGraph, producers) -> tuple[Stage, ...]:
  """Kahn's order, the graph's own order among ready stages; a cycle is named by its stages."""
  needs = {s.name: {producers[f][0].name for f in s.input_fields()} - {s.name} for s in graph.stages}
  selfish = [s.name for s in graph.stages if any(producers[f][0].name == s.name for f in s.input_fields())]
  if selfish:
    raise GraphError(f"stage {selfish[0]!r} reads a field it writes itself (a cycle)")
  done: list[Stage] = []
  while len(done) < len(graph.stages):
    ready = [s for s in graph.stages if s not in done and needs[s.name] <= {d.name for d in done}]
    if not ready:
      left = [s.name for s in graph.stages if s not in done]
      raise GraphError(f"graph {graph.name!r}: stages {left} form a cycle (each waits for another's output)")
    done.append(ready[0])
  return tuple(done)


def flow(order: tuple[Stage, ...], pools) -> tuple[Stage, ...]:
  """The stages of `order` that the worker of `pools` (the pools it holds) runs, in order."""
  return tuple(s for s in order if s.pool in pools)
