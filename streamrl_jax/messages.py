"""Typed messages between the controller, the sampler workers and the trainer worker, and their JSON codec.

Samples travel as `SampleShard` (Arrow across processes) and weights as `WeightUpdate` (Arrow chunks
across processes); everything else is one of the control records below. On the wire a record is JSON
`{"@type": name, ...fields}`; decoding checks the type name, the field names and each field's type, and
raises `BadMessage` naming the first problem. No pickle.
"""

from __future__ import annotations

import dataclasses
import json
import typing


class BadMessage(ValueError):
  """A control message that is not one of the known records, or whose fields do not fit it."""


class RejoinRequired(Exception):
  """The trainer does not know this sampler (it was declared lost, or the trainer restarted): drop the
  lease in hand and register again."""


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
  """Parameters of one policy version, placed where the receiver runs them."""

  version: int
  params: typing.Any


@dataclasses.dataclass(frozen=True)
class Register:
  """A sampler joins. `settings` are its configuration bindings, checked against the trainer's."""

  name: str
  settings: dict


@dataclasses.dataclass(frozen=True)
class Registered:
  sampler_id: int
  start_step: int
  steps: int
  heartbeat_s: float


@dataclasses.dataclass(frozen=True)
class LeaseRequest:
  """Asks for work; the controller may hold the request up to `wait_s` while no step is open."""

  sampler_id: int
  wait_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class Lease:
  """Prompts of one step leased to one sampler: generate `group_size` samples of each with weights of
  version >= `min_version`; `instances` is the replica count the controller wants the sampler to run."""

  lease_id: int
  step: int
  group_ids: tuple[int, ...]
  prompts: tuple[str, ...]
  predicted_lengths: tuple[float, ...]  # one per prompt from the ranker, or empty
  length_quantiles: tuple[float, ...]  # percentiles 0..100 of recently realised lengths, or empty
  min_version: int
  instances: int


@dataclasses.dataclass(frozen=True)
class LeaseReply:
  """A lease; or none yet (ask again); or `finished`: the run is over, leave; or `rejoin`: register again."""

  lease: Lease | None
  finished: bool
  rejoin: bool = False


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What a sampler measured while generating one lease; sent once the lease's last samples are acknowledged."""

  sampler_id: int
  lease_id: int
  step: int
  generation_s: float
  lengths: tuple[float, ...]  # mean completion tokens per prompt, in lease order
  wait_s: float  # waiting for the lease and its weights
  samples: int
  instances: int
  busy: tuple[tuple[float, float], ...]  # generation intervals, epoch seconds
  rss_mb: float = 0.0  # the sampler process's resident memory


@dataclasses.dataclass(frozen=True)
class Heartbeat:
  sampler_id: int


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
  stop: bool  # the run is over
  rejoin: bool = False  # the controller does not know this sampler: register again


@dataclasses.dataclass(frozen=True)
class VersionQuery:
  """The newest published version, waiting up to `wait_s` for one >= `min_version`."""

  min_version: int
  wait_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class VersionInfo:
  version: int  # -1: nothing published yet


@dataclasses.dataclass(frozen=True)
class Leave:
  """A sampler leaves; leases it has not reported go back to the plan."""

  sampler_id: int


@dataclasses.dataclass(frozen=True)
class Ack:
  rejoin: bool = False  # the sender is not (any more) a sampler of this run: register again


MESSAGES = {cls.__name__: cls for cls in (Register, Registered, LeaseRequest, Lease, LeaseReply, StepReport, Heartbeat,
                                          HeartbeatReply, VersionQuery, VersionInfo, Leave, Ack)}
_SIMPLE = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,)}


def _to_json(value):
  if dataclasses.is_dataclass(value):
    return {"@type": type(value).__name__, **{f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}}
  if isinstance(value, (list, tuple)):
    return [_to_json(v) for v in value]
  return value


def encode_message(message) -> bytes:
  if type(message).__name__ not in MESSAGES:
    raise TypeError(f"{type(message).__name__} is not a control message; known: {sorted(MESSAGES)}")
  return json.dumps(_to_json(message), separators=(",", ":")).encode()


def decode_message(data: bytes, expected: type | None = None):
  """The record in `data`; with `expected`, it must be of that type."""
  try:
    obj = json.loads(data)
  except (UnicodeDecodeError, json.JSONDecodeError) as err:
    raise BadMessage(f"control message is not JSON: {err}") from None
  message = _from_json(obj, "message")
  if expected is not None and not isinstance(message, expected):
    raise BadMessage(f"expected a {expected.__name__} message, got {type(message).__name__}")
  return message


def _from_json(obj, where: str):
  if not isinstance(obj, dict) or obj.get("@type") not in MESSAGES:
    raise BadMessage(f"{where}: not a known control message (need '@type' one of {sorted(MESSAGES)})")
  cls = MESSAGES[obj["@type"]]
  fields = {f.name: f for f in dataclasses.fields(cls)}
  given = set(obj) - {"@type"}
  if given - set(fields):
    raise BadMessage(f"{cls.__name__}: unknown fields {sorted(given - set(fields))}")
  required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
  if required - given:
    raise BadMessage(f"{cls.__name__}: missing fields {sorted(required - given)}")
  return cls(**{name: _field_value(obj[name], fields[name].type, f"{cls.__name__}.{name}") for name in given})


def _field_value(value, annotation: str, where: str):
  """Checks `value` against a field annotation of the forms used above; lists become tuples."""
  annotation = annotation.replace(" ", "")
  if annotation.endswith("|None"):
    return None if value is None else _field_value(value, annotation[:-5], where)
  if annotation in MESSAGES:
    return _from_json(value, where)
  if annotation.startswith("tuple["):
    if not isinstance(value, list):
      raise BadMessage(f"{where} must be a list, got {type(value).__name__}")
    inner = annotation[6:-1]
    if inner.endswith(",..."):
      return tuple(_field_value(v, inner[:-4], f"{where}[{i}]") for i, v in enumerate(value))
    parts = inner.split(",")
    if len(parts) != len(value):
      raise BadMessage(f"{where} must have {len(parts)} entries, got {len(value)}")
    return tuple(_field_value(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, parts)))
  allowed = _SIMPLE.get(annotation)
  if allowed is None:
    raise TypeError(f"{where}: annotation {annotation!r} is not supported by the codec")
  if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
    raise BadMessage(f"{where} must be {annotation}, got {type(value).__name__} {value!r}")
  return float(value) if annotation == "float" else value
