"""The Arrow schema that carries `SampleShard`s between processes, and its checked conversions.

One row per sample: its key (step, group id, sample index), the tokens it trains on (prompt then
completion, unpadded), which of them carry loss, the sampler's log-probabilities and the policy version
that sampled each token, the reward, the oldest and newest of those versions, and the envelope: the sending sampler's id and the batch's sequence number
(one value per batch, used to acknowledge and deduplicate). No pickle: the receiver checks every column
against the run's `WireLimits` (nulls at every level, finite floats within range, token ids in the
vocabulary, lengths and row counts within the run's own limits) and refuses a malformed batch with a
message naming the row and the rule. Lease rules (which sampler may send which sample) are the
controller's, not the codec's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.streaming.shard import ROUTES_DTYPE, SampleShard

# /2: per-token versions; /3: each reward function's value, failed calls; /4: no prompt_id (it was the group id);
# /5: a sample's own names (logprobs, versions; were sampler_logprobs, token_versions); /6: a mixture's routes
SCHEMA_NAME = "streamrl.samples/6"
SAMPLE_SCHEMA = pa.schema([
    ("sampler_id", pa.int64()), ("seq", pa.int64()), ("step", pa.int64()), ("group_id", pa.int64()),
    ("sample_index", pa.int64()), ("tokens", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.bool_())), ("logprobs", pa.list_(pa.float32())), ("reward", pa.float32()),
    ("first_version", pa.int64()), ("last_version", pa.int64()), ("versions", pa.list_(pa.int64())),
    ("reward_parts", pa.list_(pa.float32())), ("reward_errors", pa.int32()), ("reward_timeouts", pa.int32()),
    # a mixture of experts: per token, per sparse layer, its k experts + 1 (0: not recorded); empty: none recorded
    ("routes", pa.list_(pa.int16())),
], metadata={"schema": SCHEMA_NAME})
ROWS = {"step": "steps", "group_id": "group_ids", "sample_index": "sample_indices",
        "reward": "rewards", "first_version": "first_versions", "last_version": "last_versions",
        "reward_errors": "reward_errors", "reward_timeouts": "reward_timeouts"}
LISTS = ("tokens", "loss_mask", "logprobs", "versions")


# What a sampler can produce: a sampled token's log-probability is <= 0 and, in float32, above about -104
# (the smallest positive float's log); anything far outside would turn importance weights into 0 or inf.
LOGPROB_RANGE = (-1000.0, 1e-3)
MAX_ABS_REWARD = 1e6


class BadSampleBatch(ValueError):
  """A sample batch that does not follow `SAMPLE_SCHEMA` or its rules."""


@dataclasses.dataclass(frozen=True)
class WireLimits:
  """What a batch of this run may hold: token ids below `vocab_size`, at most `max_tokens` per sample
  (prompt and completion) and `max_rows` samples per batch."""

  vocab_size: int
  max_tokens: int = 1 << 20
  max_rows: int = 1 << 16
  routes: tuple[int, int, int] = (0, 0, 0)  # a mixture's (sparse layers, k, experts); zeros: a dense model

  @classmethod
  def of_run(cls, engine: EngineConfig, samples_per_step: int, vocab_size: int,
             model_config: ModelConfig | None = None) -> WireLimits:
    """A run's limits: its engine's longest prompt and completion, a step's samples, its model's routes."""
    routes = (0, 0, 0)
    if model_config is not None and model_config.num_experts:
      routes = (len(model_config.moe_layers), model_config.experts_per_token, model_config.num_experts)
    return cls(vocab_size, engine.cache_length, samples_per_step, routes)


@dataclasses.dataclass(frozen=True)
class SampleEnvelope:
  """Who sent a batch, and its place in that sender's sequence."""

  sampler_id: int
  seq: int


def shard_to_batch(shard: SampleShard, envelope: SampleEnvelope) -> pa.RecordBatch:
  """The shard's rows, each cut to its valid tokens (which must be a prefix of the row)."""
  lengths = shard.valid.sum(axis=1)
  if not np.array_equal(shard.valid, np.arange(shard.tokens.shape[1])[None] < lengths[:, None]):
    raise ValueError("SampleShard.valid must mark a prefix of each row to travel as Arrow lists")
  offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
  columns = {name: pa.ListArray.from_arrays(offsets, pa.array(getattr(shard, name)[shard.valid])) for name in LISTS}
  n = shard.num_samples
  columns.update(sampler_id=pa.array(np.full(n, envelope.sampler_id, np.int64)),
                 seq=pa.array(np.full(n, envelope.seq, np.int64)))
  columns.update({wire: pa.array(getattr(shard, field)) for wire, field in ROWS.items()})
  k = shard.reward_parts.shape[1]
  columns["reward_parts"] = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * k),
                                                     pa.array(shard.reward_parts.reshape(-1)))
  per_token = 0 if shard.routes is None else int(np.prod(shard.routes.shape[2:]))
  routes = np.zeros(0, np.int16) if shard.routes is None else shard.routes[shard.valid].reshape(-1)
  columns["routes"] = pa.ListArray.from_arrays(
      pa.array(np.concatenate([[0], np.cumsum(lengths) * per_token]).astype(np.int32)), pa.array(routes, pa.int16()))
  return pa.record_batch([columns[f.name] for f in SAMPLE_SCHEMA], schema=SAMPLE_SCHEMA)


def batch_to_shard(batch: pa.RecordBatch, limits: WireLimits | int) -> tuple[SampleShard, SampleEnvelope]:
  """Checks a received batch and rebuilds the shard (rows right-padded to the longest); raises
  `BadSampleBatch` naming the first problem. `limits`: the run's, or a vocabulary size alone."""
  limits = limits if isinstance(limits, WireLimits) else WireLimits(int(limits))
  _check_batch(batch, limits)
  envelope = SampleEnvelope(*(_uniform(batch, name) for name in ("sampler_id", "seq")))
  lists = {name: _list_column(batch, name) for name in LISTS}
  lengths = _check_lists(lists, limits)
  rows = {field: batch.column(wire).to_numpy() for wire, field in ROWS.items()}
  _check_rows(rows)
  rows["reward_parts"] = _reward_parts(batch)
  width = int(lengths.max())
  valid = np.arange(width)[None] < lengths[:, None]
  padded = {}
  for name, (_, values) in lists.items():
    padded[name] = np.zeros((batch.num_rows, width), values.dtype)
    padded[name][valid] = values
  if padded["loss_mask"][:, 0].any():
    raise BadSampleBatch(f"row {int(np.argmax(padded['loss_mask'][:, 0]))}: loss_mask[0] must be false (the first "
                         f"token has no prediction)")
  _check_versions(padded["versions"], padded["loss_mask"], rows)
  routes = _routes(batch, lengths, valid, limits)
  return SampleShard(valid=valid, **padded, **rows, routes=routes), envelope


def _routes(batch: pa.RecordBatch, lengths: np.ndarray, valid: np.ndarray, limits: WireLimits) -> np.ndarray | None:
  """[rows, width, sparse layers, k] of the routes column (None when no row carries any): each row's list is empty or
  holds every token's, each value an expert + 1 of this run's model (0: not recorded)."""
  offsets, values = _list_column(batch, "routes")
  counts = np.diff(offsets)
  if not counts.any():
    return None
  layers, k, experts = limits.routes
  if not layers:
    raise BadSampleBatch(f"row {int(np.argmax(counts > 0))}: routes given, but this run's model has no experts")
  bad = (counts != 0) & (counts != lengths * layers * k)
  if bad.any():
    row = int(np.argmax(bad))
    raise BadSampleBatch(f"row {row}: routes must hold {layers} layers x {k} experts for each of its {lengths[row]} "
                         f"tokens ({lengths[row] * layers * k} values) or none, got {counts[row]}")
  if values.size and (values.min() < 0 or values.max() > experts):
    row = int(np.searchsorted(offsets, np.flatnonzero((values < 0) | (values > experts))[0], "right")) - 1
    raise BadSampleBatch(f"row {row}: routes must lie in [0, {experts}] (an expert + 1, 0: not recorded)")
  out = np.zeros(valid.shape + (layers, k), ROUTES_DTYPE)
  holds = np.repeat(counts > 0, lengths)  # the valid tokens of rows that sent routes
  flat = out[valid]
  flat[holds] = values.reshape(-1, layers, k)
  out[valid] = flat
  return out


def _check_batch(batch: pa.RecordBatch, limits: WireLimits) -> None:
  """The schema, well-formed Arrow, a row count within the run's, and no nulls at any level."""
  _check_schema(batch.schema)
  try:
    batch.validate(full=True)  # offsets within bounds, buffers of the right size
  except pa.ArrowException as err:
    raise BadSampleBatch(f"sample batch is not well-formed Arrow: {str(err)[:200]}") from None
  if batch.num_rows == 0:
    raise BadSampleBatch("sample batch has no rows")
  if batch.num_rows > limits.max_rows:
    raise BadSampleBatch(f"sample batch has {batch.num_rows} rows; this run takes at most {limits.max_rows} "
                         f"(a step's samples)")
  for column, field in zip(batch.columns, batch.schema):
    if column.null_count:
      raise BadSampleBatch(f"sample batch column {field.name!r} holds {column.null_count} nulls")
    if field.name in (*LISTS, "reward_parts", "routes") and column.values.null_count:
      raise BadSampleBatch(f"sample batch column {field.name!r} holds {column.values.null_count} nulls inside its lists")


def _check_lists(lists: dict, limits: WireLimits) -> np.ndarray:
  """Every list column as long as 'tokens' in each row, token ids in the vocabulary, lengths within the run's,
  log-probabilities in range; returns each row's length."""
  lengths = np.diff(lists["tokens"][0])
  for name in LISTS[1:]:
    bad = np.flatnonzero(np.diff(lists[name][0]) != lengths)
    if bad.size:
      raise BadSampleBatch(f"row {bad[0]}: {name!r} has {np.diff(lists[name][0])[bad[0]]} entries but 'tokens' has "
                           f"{lengths[bad[0]]}")
  tokens, vocab_size = lists["tokens"][1], limits.vocab_size
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    row = int(np.searchsorted(lists["tokens"][0], np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0], "right")) - 1
    raise BadSampleBatch(f"row {row}: token ids must lie in [0, {vocab_size}) (the vocabulary)")
  if lengths.min() < 2:
    raise BadSampleBatch(f"row {int(np.argmin(lengths))}: a sample needs at least 2 tokens (prompt and completion)")
  if lengths.max() > limits.max_tokens:
    raise BadSampleBatch(f"row {int(np.argmax(lengths))}: {int(lengths.max())} tokens; this run's samples hold at most "
                         f"{limits.max_tokens} (prompt and completion)")
  logprobs = lists["logprobs"][1]
  bad = ~np.isfinite(logprobs) | (logprobs < LOGPROB_RANGE[0]) | (logprobs > LOGPROB_RANGE[1])
  if bad.any():
    row = int(np.searchsorted(lists["logprobs"][0], np.flatnonzero(bad)[0], "right")) - 1
    raise BadSampleBatch(f"row {row}: logprobs must be finite and in [{LOGPROB_RANGE[0]:g}, 0], got "
                         f"{logprobs[np.flatnonzero(bad)[0]]!r}")
  return lengths


def _reward_parts(batch: pa.RecordBatch) -> np.ndarray:
  """[rows, functions]: every row lists one finite value per reward function, the same count in each."""
  offsets, values = _list_column(batch, "reward_parts")
  counts = np.diff(offsets)
  if counts.min() < 1 or (counts != counts[0]).any():
    raise BadSampleBatch(f"row {int(np.argmax(counts != counts[0]) if counts.min() >= 1 else np.argmin(counts))}: "
                         "reward_parts must hold one value per reward function, as many in every row")
  bad = ~(np.abs(values) <= MAX_ABS_REWARD)
  if bad.any():
    raise BadSampleBatch(f"row {int(np.flatnonzero(bad)[0]) // counts[0]}: reward_parts must be finite, "
                         f"|value| <= {MAX_ABS_REWARD:g}")
  return values.reshape(len(counts), counts[0])


def _check_schema(schema: pa.Schema) -> None:
  name = (schema.metadata or {}).get(b"schema", b"").decode(errors="replace")
  if name.startswith("streamrl.samples/") and name != SCHEMA_NAME:
    raise BadSampleBatch(f"sample batch is of schema {name!r}, this trainer reads {SCHEMA_NAME!r}: run the samplers "
                         f"and the trainer from one version of streamrl_jax")
  if name != SCHEMA_NAME:
    raise BadSampleBatch(f"sample batch schema is not {SCHEMA_NAME!r} (metadata {schema.metadata})")
  got = {f.name: f.type for f in schema}
  for field in SAMPLE_SCHEMA:
    if field.name not in got:
      raise BadSampleBatch(f"sample batch lacks column {field.name!r}")
    if got[field.name] != field.type:
      raise BadSampleBatch(f"sample batch column {field.name!r} has type {got[field.name]}, expected {field.type}")
  extra = sorted(set(got) - set(SAMPLE_SCHEMA.names))
  if extra or schema.names != SAMPLE_SCHEMA.names:
    raise BadSampleBatch(f"sample batch columns {schema.names} differ from {SAMPLE_SCHEMA.names} (extra: {extra})")


def _uniform(batch: pa.RecordBatch, name: str) -> int:
  values = batch.column(name).to_numpy()
  if (values != values[0]).any():
    raise BadSampleBatch(f"sample batch column {name!r} must hold one value for the whole batch")
  if values[0] < 0:
    raise BadSampleBatch(f"sample batch {name!r} must be >= 0, got {values[0]}")
  return int(values[0])


def _list_column(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
  """(offsets relative to the first, flat values) of a list column."""
  column = batch.column(name)
  offsets = column.offsets.to_numpy()
  values = column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
  return offsets - offsets[0], values


def _check_versions(versions: np.ndarray, loss_mask: np.ndarray, rows: dict) -> None:
  """Every trained token's version is one of its sample's: >= 0, its oldest first_version, its newest last_version."""
  big = np.iinfo(np.int64)
  oldest = np.where(loss_mask, versions, big.max).min(axis=1)
  newest = np.where(loss_mask, versions, big.min).max(axis=1)
  has = loss_mask.any(axis=1)
  for bad, message in ((has & (oldest < 0), "versions must be >= 0"),
                       (has & (oldest != rows["first_versions"]), "the oldest of versions must be first_version"),
                       (has & (newest != rows["last_versions"]), "the newest of versions must be last_version")):
    if bad.any():
      raise BadSampleBatch(f"row {int(np.argmax(bad))}: {message}")


def _check_rows(rows: dict) -> None:
  checks = [("steps", rows["steps"] < 0, "step must be >= 0"),
            ("group_ids", rows["group_ids"] < 0, "group_id must be >= 0"),
            ("sample_indices", rows["sample_indices"] < 0, "sample_index must be >= 0"),
            ("first_versions", rows["first_versions"] < 0, "first_version must be >= 0"),
            ("last_versions", rows["last_versions"] < rows["first_versions"], "last_version must be >= first_version"),
            ("rewards", ~(np.abs(rows["rewards"]) <= MAX_ABS_REWARD),
             f"reward must be finite, |reward| <= {MAX_ABS_REWARD:g}"),
            ("reward_errors", rows["reward_errors"] < 0, "reward_errors must be >= 0"),
            ("reward_timeouts", rows["reward_timeouts"] < 0, "reward_timeouts must be >= 0")]
  for _, bad, message in checks:
    if bad.any():
      raise BadSampleBatch(f"row {int(np.argmax(bad))}: {message}")
