"""The JSON codec of the control messages (`messages`): `{"@type": name, ...fields}` on the wire; decoding checks the
type name, the field names, each field's type and its bounds (`LIMITS`), and raises `BadMessage` naming the first
problem. No pickle. A message is at most `MAX_MESSAGE_BYTES`; every number finite and within 64 bits. Only a field
annotated `X | None` may be null (JSON `null` is None, e.g. `Rollout.loss_mask`: every token the model's)."""

from __future__ import annotations

import dataclasses
import json
import math

from streamrl_jax.messages import (QUOTE_CHARS, Ack, ArmJoin, ArmJoined, ArmPoll, ArmState, Backfill, Backfilled,
                                   BadMessage, Delivery, DeliveryStatus, Heartbeat, HeartbeatReply, Lease,
                                   LeaseReply, LeaseRequest, Leave, Published, Register, Registered, Regenerate,
                                   SamplerWait, SamplerWaitQuery, ScoreRequest, ScorerInfo, ScorerQuery, Scores,
                                   StepReport, StepSummary, StepSummaryRequest, StepTrained, VersionInfo, VersionQuery,
                                   quote)
from streamrl_jax.types import Rollout

MAX_MESSAGE_BYTES = 4 << 20  # a Register's settings, a Lease's prompts: far below this
INT_RANGE = (-(1 << 63), (1 << 63) - 1)
# Per field: the range its value (or each entry of a tuple) must lie in, or a string's most characters.
LIMITS = {
    "LeaseRequest.wait_s": (0.0, 60.0), "VersionQuery.wait_s": (0.0, 60.0), "VersionQuery.min_version": (-1, 1 << 62),
    "Register.name": 256, "Register.site": 64, "Register.relay": 256, "VersionInfo.source": 256,
    "StepReport.generation_s": (0.0, 1e7), "StepReport.wait_s": (0.0, 1e7),
    "StepReport.lengths": (0.0, 1e9), "StepReport.samples": (0, 1 << 40), "StepReport.instances": (0, 1 << 20),
    "StepReport.rss_mb": (0.0, 1e9), "StepReport.busy": (0.0, 1e12), "Lease.instances": (0, 1 << 20),
    "StepReport.phase_s": (0.0, 1e9), "StepSummary.phase_s": (0.0, 1e12),
    "StepReport.template_prefix_mismatch": (0, 1 << 40), "StepSummary.template_prefix_mismatch": (0, 1 << 40),
    "Registered.heartbeat_s": (0.0, 1e6), "Registered.data_endpoints": 256,
    "Delivery.group_ids": (0, 1 << 62), "Delivery.lengths": (0.0, 1e9), "DeliveryStatus.status": 16,
    "DeliveryStatus.reason": 600, "Rollout.completion_tokens": (0, (1 << 31) - 1), "Rollout.logprobs": (-1000.0, 1e-3),
    "Rollout.versions": (0, 1 << 62), "Rollout.sample_index": (0, 1 << 20), "Rollout.group_id": (0, 1 << 62),
    "Lease.prompt_tokens": (0, (1 << 31) - 1),
    "Published.version": (-1, 1 << 62), "StepTrained.step": (0, 1 << 62), "StepTrained.train_s": (0.0, 1e7),
    "StepSummary.generation_s": (0.0, 1e7), "StepSummary.sampler_instances": (0, 1 << 40),
    "StepSummary.sampler_processes": (0, 1 << 40), "StepSummary.sampler_rss_mb": (0.0, 1e9),
    "Regenerate.group_ids": (0, 1 << 62), "Backfill.filtered": (0, 1 << 62), "Backfilled.count": (0, 1 << 40),
    "SamplerWait.seconds": (0.0, 1e12),
    "ArmJoin.name": 64, "ArmJoin.run_id": 64, "ArmPoll.name": 64, "ArmPoll.run_id": 64,
    "ArmPoll.checkpointed": (0, 1 << 40), "ArmState.dropped": (0, 1 << 40),
    "ScorerQuery.stage": 128, "ScorerInfo.stage": 128, "ScorerInfo.kind": 16, "ScorerInfo.vocab_size": (1, 1 << 31),
    "ScoreRequest.rows": (0, 1 << 20), "ScoreRequest.length": (1, 1 << 20),
    "ScoreRequest.tokens": (0, (1 << 31) - 1), "Scores.values": (-1e9, 1e9),
}


MESSAGES = {cls.__name__: cls for cls in (Register, Registered, LeaseRequest, Rollout, Lease, LeaseReply, StepReport,
                                          Heartbeat, HeartbeatReply, VersionQuery, VersionInfo, Leave, Ack, Published,
                                          Delivery, DeliveryStatus, StepTrained, StepSummaryRequest, StepSummary,
                                          Regenerate, Backfill,
                                          Backfilled, SamplerWaitQuery, SamplerWait, ArmJoin, ArmJoined, ArmPoll,
                                          ArmState, ScorerQuery, ScorerInfo, ScoreRequest, Scores)}
_SIMPLE = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,)}


def _to_json(value):
  if dataclasses.is_dataclass(value):
    fields = {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return {"@type": type(value).__name__, **fields}
  if isinstance(value, (list, tuple)):
    return [_to_json(v) for v in value]
  return value


def encode_message(message) -> bytes:
  if type(message).__name__ not in MESSAGES:
    raise TypeError(f"{type(message).__name__} is not a control message; known: {sorted(MESSAGES)}")
  return json.dumps(_to_json(message), separators=(",", ":")).encode()


def decode_message(data: bytes, expected: type | None = None):
  """The record in `data`; with `expected`, it must be of that type."""
  if len(data) > MAX_MESSAGE_BYTES:
    raise BadMessage(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
  try:
    obj = json.loads(data, parse_constant=_no_constant)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
    raise BadMessage(f"control message is not JSON: {str(err)[:QUOTE_CHARS]}") from None
  message = _from_json(obj, "message")
  if expected is not None and not isinstance(message, expected):
    raise BadMessage(f"expected a {expected.__name__} message, got {type(message).__name__}")
  return message


def _no_constant(name: str):
  raise BadMessage(f"control message holds {name}: numbers must be finite")


def _from_json(obj, where: str):
  if not isinstance(obj, dict) or obj.get("@type") not in MESSAGES:
    raise BadMessage(f"{where}: not a known control message (need '@type' one of {sorted(MESSAGES)})")
  cls = MESSAGES[obj["@type"]]
  fields = {f.name: f for f in dataclasses.fields(cls)}
  given = set(obj) - {"@type"}
  if given - set(fields):
    raise BadMessage(f"{cls.__name__}: unknown fields {quote(sorted(given - set(fields)))}")
  required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
  if required - given:
    raise BadMessage(f"{cls.__name__}: missing fields {sorted(required - given)}")
  values = {}
  for name in given:
    where = f"{cls.__name__}.{name}"
    values[name] = _field_value(obj[name], fields[name].type, where)
    _check_limit(values[name], LIMITS.get(where), where)
  try:
    return cls(**values)
  except ValueError as err:  # a record's own rule (e.g. one log-probability per token)
    raise BadMessage(f"{cls.__name__}: {str(err)[:2 * QUOTE_CHARS]}") from None


def _check_limit(value, limit, where: str) -> None:
  if limit is None or value is None:  # None: an optional field left out (its type was checked)
    return
  if isinstance(value, tuple):
    for i, v in enumerate(value):
      _check_limit(v, limit, f"{where}[{i}]")
  elif isinstance(limit, int):
    if len(value) > limit:
      raise BadMessage(f"{where} has {len(value)} characters; at most {limit}")
  elif not limit[0] <= value <= limit[1]:
    raise BadMessage(f"{where} must lie in [{limit[0]}, {limit[1]}], got {quote(value)}")


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
    raise BadMessage(f"{where} must be {annotation}, got {type(value).__name__} {quote(value)}")
  if isinstance(value, float) and not math.isfinite(value):
    raise BadMessage(f"{where} must be finite, got {value}")
  if isinstance(value, int) and not isinstance(value, bool) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
    raise BadMessage(f"{where} does not fit 64 bits")
  return float(value) if annotation == "float" else value
