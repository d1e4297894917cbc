"""One pool's flow: the function stages a worker runs over a shard's fields, in the graph's order, each output
checked (its shape by its type, floats finite) before any reaches the weights; a stage that raises stops the run by
its name. The role's own programs (generate, reward, update) are the worker's, not the flow's.

On a trainer of several processes every process runs the flow over the same shards in the same order, each holding
the tokens of its own samples alone (`owners`, a field of their view): a model's stage scores each sample on its
owner's devices and hands every score to every process; a function's per-sample outputs are its owners' values,
exchanged (one all-gather of a [rows] array an output), so every process goes on with the same view; a per-token
output is right on its owner, the only process that trains those tokens, and the step's sums of one add up over the
processes."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from streamrl_jax import launch
from streamrl_jax.workflow.graph import WIRE_FIELDS, Stage, port
from streamrl_jax.workflow.ops import FLOW_KEYWORDS, resolve_op



class StageError(ValueError):
  """A stage raised, or returned what its outputs' types refuse."""


class StageFlow:
  """Runs `stages` (a pool's part of the graph's order) over fields; `keywords`: the flow's (`FLOW_KEYWORDS`: the
  run's `estimator`, the policy's `objective`), `models`: name -> a frozen model's log-probs(tokens, valid)."""

  def __init__(self, stages: tuple[Stage, ...], keywords: Mapping[str, object],
               models: Mapping[str, Callable] | None = None):
    # the models that learn (a critic): stepped once a step (`end_step`), their `state` checkpointed with the policy's
    self.learners = {name: m for name, m in (models or {}).items() if hasattr(m, "end_step")}
    self.calls = []
    for stage in stages:
      op = resolve_op(stage.op)
      if op.fn is None:
        continue
      given = {**keywords, "model": (models or {}).get(op.model)} if op.model else dict(keywords)
      wanted = _keywords(op.fn)
      params = dict(stage.params)
      kwargs = {k: v for k, v in given.items() if k in wanted and k not in params}
      self.calls.append((stage, op.fn, {**kwargs, **params}))

  def run(self, fields: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`fields` with every stage's outputs added."""
    fields = dict(fields)
    rows, length = np.shape(fields["tokens"])
    owners = fields.get("owners")
    for stage, fn, kwargs in self.calls:
      given = {**kwargs, "owners": owners} if owners is not None and "owners" in _keywords(fn) else kwargs
      try:
        out = fn(*(fields[f] for f in stage.input_fields()), **given)
      except Exception as err:  # noqa: BLE001 - a user's stage failed: named, the run stops
        raise StageError(f"stage {stage.name!r} ({stage.op}) raised {type(err).__name__}: {err}") from err
      outs = () if out is None and not stage.outputs else out if isinstance(out, tuple) else (out,)
      if len(outs) != len(stage.outputs):
        raise StageError(f"stage {stage.name!r} returned {len(outs)} arrays for its outputs {list(stage.outputs)}")
      for text, value in zip(stage.outputs, outs):
        field, (kind,) = port(text, stage.name)
        fields[field] = checked(stage.name, field, kind, value, rows, length)
        if owners is not None and kind == "sample" and not resolve_op(stage.op).model:
          fields[field] = owners_values(fields[field], owners)
    return fields

  def end_step(self) -> dict[str, float]:
    """Each learner's optimizer step on what the step's shards added; their row keys."""
    return {k: v for learner in self.learners.values() for k, v in learner.end_step().items()}

  def sums(self, fields: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each float field the flow's stages wrote: over the samples, or a token field's over the loss
    tokens (with `owners`, each process's own, added up over the processes); what a step's row reports as
    `stage/<field>` (the mean over its shards)."""
    out, tokens = {}, []
    for stage, _, _ in self.calls:
      for text in stage.outputs:
        field, (kind,) = port(text, stage.name)
        if kind == "sample":
          out[field] = (float(np.sum(fields[field])), float(len(fields[field])))
        elif kind == "token":
          mask = fields["loss_mask"]
          out[field] = (float(np.sum(np.where(mask, fields[field], 0.0))), float(np.sum(mask)))
          tokens.append(field)
    if tokens and "owners" in fields:  # each process summed its own samples' loss tokens
      summed = process_sum(np.asarray([out[f] for f in tokens], np.float64))
      out.update({f: (float(total), float(count)) for f, (total, count) in zip(tokens, summed)})
    return out


def shard_fields(shard, owned: bool = False) -> dict[str, np.ndarray]:
  """A `SampleShard`'s wire fields by name (`completion_lengths` from its token counts, which every process of a
  trainer holds for every row, whoever holds the tokens); `owned` (a trainer of several processes): with each
  sample's `owners`."""
  fields = {name: getattr(shard, name) for name in WIRE_FIELDS if name != "completion_lengths"}
  fields["completion_lengths"] = shard.stats[:, 0].astype(np.float32)
  return {**fields, "owners": np.asarray(shard.owners)} if owned else fields


def owners_values(values: np.ndarray, owners: np.ndarray) -> np.ndarray:
  """Each sample's value as its owner process computed it, on every process (their sum over the processes of each
  one's own samples' values)."""
  mine = np.where(np.asarray(owners) == jax.process_index(), values, 0.0).astype(np.float64)
  return process_sum(mine).astype(values.dtype)


def process_sum(values: np.ndarray) -> np.ndarray:
  """`values` summed over a trainer's processes (an all-gather over every device, through their launcher)."""
  gathered = launch.launcher(jax.devices())(multihost_utils.process_allgather, values)
  return np.asarray(gathered).sum(axis=0)


def checked(stage: str, field: str, kind: str, value, rows: int, length: int) -> np.ndarray:
  """`value` as `kind`'s array for `rows` samples of `length` tokens, else StageError naming the stage and field."""
  array = np.asarray(value)
  shape = (rows,) if kind in ("sample", "group") else (rows, length)
  if array.shape != shape:
    raise StageError(f"stage {stage!r} wrote {field!r} of shape {array.shape}; a {kind} field is {shape}")
  if kind in ("sample", "token"):
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
      raise StageError(f"stage {stage!r} wrote {field!r} of dtype {array.dtype}; a {kind} field is numbers")
    if not np.all(np.isfinite(array)):
      raise StageError(f"stage {stage!r} wrote {field!r} with values that are not finite numbers")
    return array.astype(np.float32)
  return array


def _keywords(fn) -> set[str]:
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return set()
  return {k for k in FLOW_KEYWORDS if k in parameters}
