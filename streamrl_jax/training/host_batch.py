"""A micro-batch on the host, before the trainer places it: the arrays each role needs, their checks (a missing key
or a wrong shape refused by name) and their padding to a call's (rows, length) bucket."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from streamrl_jax import launch
from streamrl_jax.models.sharding import logical_spec
from streamrl_jax.training.logprobs import scored_columns
from streamrl_jax.training.owned_rows import owned_layout, owned_slots, put_owned

BATCH_KEYS = {"policy": ("tokens", "valid", "loss_mask", "advantages", "logprobs"),
              "critic": ("tokens", "valid", "loss_mask", "returns", "old_values")}


ROUTED = "routes"  # a mixture's routes: [rows, length, sparse layers, k] per token, the one key of more than 2 axes
# a policy's tokens sampled by weights older than those the call trains (the mismatch's staleness part); default none
STALE = "stale"


def pad_rows(value: np.ndarray, rows: int, columns: int) -> np.ndarray:
  """`value` [r, c, ...] zero-padded to [r + rows, c + columns, ...]."""
  return np.pad(value, ((0, rows), (0, columns)) + ((0, 0),) * (np.ndim(value) - 2))


def lossless_batch(keys: tuple, rows: int, length: int, packed: bool, routes: tuple | None = None) -> dict:
  """A micro-batch of `keys` of this shape that carries no loss (accumulating it compiles and changes nothing);
  `routes` (sparse layers, k): a mixture's, none recorded."""
  batch = {k: np.zeros((rows, length), np.float32) for k in keys if k != "tokens"}
  batch.update(tokens=np.zeros((rows, length), np.int32), valid=np.full((rows, length), not packed),
               loss_mask=np.zeros((rows, length), bool))
  if packed:
    batch["segment_ids"] = np.zeros((rows, length), np.int32)
  if routes is not None:
    batch[ROUTED] = np.zeros((rows, length) + tuple(routes), np.int16)
  return batch


def checked(batch: dict, keys: tuple, extra: tuple, role: str) -> dict:
  """The micro-batch's arrays of `keys` and `extra`, each [rows, length] (a per-sample advantage spread over its
  tokens); a missing key, a shape unlike the tokens' or a loss on the first token is refused by name."""
  missing = [k for k in keys if k not in batch]
  if missing:
    raise KeyError(f"micro-batch lacks {missing}; a {role} micro-batch needs {list(keys)}")
  rows, length = np.asarray(batch["tokens"]).shape
  if np.asarray(batch["loss_mask"])[:, 0].any():
    raise ValueError("loss_mask[:, 0] must be False: the first token has no prediction")
  values = {}
  for key in keys + extra:
    value = np.asarray(batch[key])
    if key == "advantages" and value.ndim == 1:
      value = np.repeat(value[:, None], length, axis=1)
    if value.shape[:2] != (rows, length) or (value.ndim != 2 and key != ROUTED):
      raise ValueError(f"micro-batch {key!r} has shape {value.shape}, expected {(rows, length)}")
    values[key] = value
  return values


def padded_call(values: dict, shape: tuple, role: str) -> dict:
  """A micro-batch's arrays padded to `shape`; a policy's with `head_columns` where its loss fits them: the head
  then scores those tokens alone, not the prompts (`logprobs.scored_columns`)."""
  rows, length = values["tokens"].shape
  padded = {k: pad_rows(v, shape[0] - rows, shape[1] - length) for k, v in values.items()}
  columns = scored_columns(padded["loss_mask"]) if role == "policy" else None
  return padded if columns is None else {**padded, "head_columns": columns}


def bucket(n: int, minimum: int) -> int:
  """The smallest power-of-two multiple of `minimum` that holds `n`: the padded sizes a call compiles for."""
  size = minimum
  while size < n:
    size *= 2
  return size


def placed_rows(values: dict, owners, mesh, min_shape: tuple[int, int], rules=None) -> tuple[dict, np.ndarray]:
  """(`values` [rows, length, ...] (its `valid` marking each row's tokens) padded to the power-of-two buckets of
  `min_shape` and put on `mesh`, rows split over its batch axes; each row's row in the placed batch). With `owners`
  [rows] (a trainer of several processes: each row's holder, its tokens zeros elsewhere), each row lies on its owner's
  devices, built from the owner's copy alone (`owned_rows`), and a row without a valid token is left out (-1)."""
  rows, length = np.shape(values["valid"])
  sharding_for = lambda shape: NamedSharding(mesh, logical_spec(("batch", None), shape, mesh, rules))  # noqa: E731
  if owners is not None:
    out, shape, where = owned_slots(values, np.asarray(owners), bucket(length, min_shape[1]),
                                    lambda n: bucket(n, min_shape[0]), sharding_for, jax.process_count())
    return put_owned(out, sharding_for(shape)), where
  shape = (bucket(rows, min_shape[0]), bucket(length, min_shape[1]))
  padded = {k: pad_rows(np.asarray(v), shape[0] - rows, shape[1] - np.shape(v)[1]) for k, v in values.items()}
  return launch.put(padded, sharding_for(shape)), np.arange(rows)


def read_rows(scores, where: np.ndarray) -> np.ndarray:
  """A frozen model's scores of a placed batch (replicated on every device) back in the caller's row order: row i's
  from row `where[i]`, zeros for a row left out."""
  out = np.asarray(scores)
  picked = out[np.maximum(where, 0)]
  return np.where((where >= 0).reshape((-1,) + (1,) * (picked.ndim - 1)), picked, 0).astype(out.dtype)


@dataclasses.dataclass(frozen=True)
class CallLayout:
  """How a trainer's calls are laid out on its mesh: its role's keys, the power-of-two (rows, length) buckets padded
  calls take from (`min_rows`, `min_length`), packed rows a multiple of the mesh's batch shards, and each call's rows
  split over those shards (`rules`: the logical sharding rules)."""

  role: str
  mesh: Mesh
  rules: Mapping
  min_rows: int = 8
  min_length: int = 16

  @property
  def packed_row_quantum(self) -> int:
    """Packed rows split evenly over the batch axes: their count is a multiple of this."""
    return self.mesh.shape.get("data", 1) * self.mesh.shape.get("fsdp", 1)

  def placed(self, batch: dict, route_shape: tuple | None) -> tuple[dict, tuple[int, int]]:
    """(the micro-batch checked, padded to its (rows, length) bucket and put on the mesh, that shape); padding rows
    carry no loss. A batch with `owners` (a trainer of several processes: each row's holder) is laid out by them
    (`owned_rows`). `route_shape`: a mixture's (sparse layers, k)."""
    values, shape, packed = self.checked(batch, route_shape)
    if "owners" in batch:
      out, shape = owned_layout(values, np.asarray(batch["owners"])[:, 0], shape[1], self.rows_for(packed),
                                self.sharding, jax.process_count())
      return put_owned(out, self.sharding(shape)), shape
    return launch.put(padded_call(values, shape, self.role), self.sharding(shape)), shape

  def checked(self, batch: dict, route_shape: tuple | None) -> tuple[dict, tuple[int, int], bool]:
    """(the micro-batch's checked arrays with the keys every call of this role carries, its padded shape, packed)."""
    rows, length = np.asarray(batch["tokens"]).shape
    packed = "segment_ids" in batch
    if route_shape is not None and ROUTED not in batch:  # a mixture's calls all carry routes: one program
      batch = {**batch, ROUTED: np.zeros((rows, length) + route_shape, np.int16)}
    if self.role == "policy" and STALE not in batch:  # every policy call carries it: one program
      batch = {**batch, STALE: np.zeros((rows, length), bool)}
    extra = (("old_logprobs",) if "old_logprobs" in batch and self.role == "policy" else ()) + (
        (STALE,) if self.role == "policy" else ()) + (
        ("segment_ids",) if packed else ()) + ((ROUTED,) if route_shape is not None else ())
    values = checked(batch, BATCH_KEYS[self.role], extra, self.role)
    return values, (self.rows_for(packed)(rows), length if packed else bucket(length, self.min_length)), packed

  def rows_for(self, packed: bool):
    """A call's padded row count for `n` rows: packed rows to a multiple of the batch shards, else a bucket."""
    if packed:
      return lambda n: -(-n // self.packed_row_quantum) * self.packed_row_quantum
    return lambda n: bucket(n, self.min_rows)

  def sharding(self, shape: tuple[int, int]) -> NamedSharding:
    return NamedSharding(self.mesh, logical_spec(("batch", None), shape, self.mesh, self.rules))

  def shapes(self, rows: int, length: int, packed: bool, route_shape: tuple | None) -> dict:
    """The arguments of a call of this shape as shapes on the mesh, every column scored (the most a call of this shape
    needs: `placed` gathers the loss's columns when they fit half the row)."""
    batch = lossless_batch(BATCH_KEYS[self.role], rows, length, packed, route_shape)
    values, shape, _ = self.checked(batch, route_shape)
    call = padded_call(values, shape, self.role)
    call.pop("head_columns", None)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.sharding(shape)) for k, v in call.items()}
