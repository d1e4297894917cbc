"""The trainer's Arrow Flight server (on its process 0): samples in by DoPut, weights out by DoGet, control
messages by DoAction. It moves typed records and does no training math.

- DoPut (descriptor command `samples`): one `SAMPLE_SCHEMA` batch per call. It is checked against the run's
  `WireLimits` and the controller's lease rules, deduplicated on (sampler id, sequence number), put into the
  trainer's bounded `SampleQueue` and acknowledged (status `rejoin` instead when the controller does not
  know the sampler, `trained` when its step is trained already: neither is taken); a full queue refuses the
  batch as UNAVAILABLE (the sender keeps it and retries: backpressure, never a drop); a malformed batch or
  one outside the sender's leases is refused with a message naming the row and the rule, counted, and the
  connection stays usable. Nothing is acknowledged as accepted that the trainer will not take.
- DoGet (ticket `{"weights": version}`): the tensors of a published version in chunks (`weight_chunks`).
- DoGet (ticket `{"arm": NAME, "after": SEQ}`): a follower arm's program reads its stream of samples
  (`pipeline.remote_arms`), the shards numbered above SEQ.
- DoAction (type `control`): a JSON control message in, its reply out (`streamrl_jax.messages`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from streamrl_jax.counters import Counters
from streamrl_jax import launch
from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import QUOTE_CHARS, ArmJoin, ArmPoll, BadMessage, BadShard, VersionInfo, VersionQuery
from streamrl_jax.models.precision import SamplerPrecision, to_wire
from streamrl_jax.pytrees import flatten_with_names
from streamrl_jax.streaming.queue import QueueClosed, SampleQueue
from streamrl_jax.streaming.sample_schema import (SAMPLE_SCHEMA, BadSampleBatch, SampleEnvelope, WireLimits,
                                                  batch_to_shard, shard_to_batch)
from streamrl_jax.streaming.weight_chunks import (DEFAULT_CHUNK_BYTES, manifest_of, part_indices, read_weights_ticket,
                                                  weight_batches, weight_schema)
from streamrl_jax.streaming.weight_pieces import PIECES_KEY, encode_where, own_pieces

SAMPLES_COMMAND = b"samples"
VERSION_GONE = "weights of this version are no longer held"  # the trainer moved on, or restarted
PIECES_WAIT_S = 60.0  # how long a trainer process's door waits for a version process 0 already announced


@dataclasses.dataclass(frozen=True)
class TLSFiles:
  """PEM files for mutual TLS: this side's certificate and key, and the CA that signs the other side's."""

  cert: str
  key: str
  ca: str

  def read(self) -> tuple[bytes, bytes, bytes]:
    out = []
    for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
      if not Path(path).is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
      out.append(Path(path).read_bytes())
    return tuple(out)

  @classmethod
  def from_flags(cls, cert: str | None, key: str | None, ca: str | None) -> TLSFiles | None:
    given = [x for x in (cert, key, ca) if x]
    if not given:
      return None
    if len(given) != 3:
      raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
    return cls(cert, key, ca)


def server_tls_options(tls: TLSFiles | None) -> dict:
  """FlightServerBase keyword arguments for mutual TLS (none without `tls`)."""
  if tls is None:
    return {}
  cert, key, ca = tls.read()
  return dict(tls_certificates=[flight.CertKeyPair(cert, key)], verify_client=True, root_certificates=ca)


class HostWeightStore:
  """The trainer side of the weight transport across processes: host copies of the newest versions.

  `publish` copies the parameters on their devices at once (the trainer may donate them to its next step
  right after) and moves them to the host on a worker thread. With `pieces` (a process of a trainer of several) it
  keeps only the pieces its own devices hold (`weight_pieces.own_pieces`, synchronously), and a stream of them says
  where each lies. With a `precision`, a version is stored as its wire pytree (`models.precision.to_wire`);
  without, as the parameters."""

  def __init__(self, *, keep: int = 2, precision: SamplerPrecision | None = None, pieces: bool = False):
    self._keep, self._precision, self._pieces = keep, precision, pieces
    self._cond = threading.Condition()
    self._versions: dict[int, tuple[list, list]] = {}  # version -> (manifest, host arrays in its order)
    self._where: dict[int, dict] = {}  # version -> where each piece lies (pieces only)
    self._threads: list[threading.Thread] = []
    self._error: BaseException | None = None
    self._waits_ended = False  # `end_waits`: the server is shutting down, a long poll answers at once
    self.seconds: dict[int, float] = {}

  def publish(self, params, version: int) -> None:
    start = time.perf_counter()
    if self._precision is not None:
      params = to_wire(params, self._precision)
    if self._pieces:
      flat, where = own_pieces(params, jax.process_index(), jax.process_count())
      self._store(flat, version, start, where)
      return
    copied = launch.copy(params)
    thread = threading.Thread(target=self._to_host, args=(copied, version, start), daemon=True,
                              name=f"weights-to-host-{version}")
    thread.start()
    self._threads = [t for t in self._threads if t.is_alive()] + [thread]

  def _to_host(self, params, version: int, start: float) -> None:
    try:
      self._store(jax.tree.map(np.asarray, params), version, start)
    except BaseException as err:  # surfaced by get()/wait()
      with self._cond:
        self._error = err
        self._cond.notify_all()

  def _store(self, host_params, version: int, start: float, where: dict | None = None) -> None:
    """Keeps a version: `host_params` a pytree of host arrays, or with `where` the named pieces already."""
    named = host_params if where is not None else flatten_with_names(host_params)
    flat = {k: np.require(v, requirements="C") for k, v in named.items()}  # a scalar stays a scalar
    with self._cond:
      self._versions[version] = (manifest_of(flat), list(flat.values()))
      self._where[version] = where
      for old in sorted(self._versions)[:-self._keep]:
        del self._versions[old], self._where[old]
      self.seconds[version] = time.perf_counter() - start
      self._cond.notify_all()

  def latest_version(self) -> int:
    with self._cond:
      self._raise_error()
      return max(self._versions, default=-1)

  def wait_version(self, min_version: int, timeout: float) -> int:
    """The newest stored version, after waiting up to `timeout` s for one >= `min_version`."""
    with self._cond:
      self._cond.wait_for(lambda: self._error is not None or self._waits_ended
                          or max(self._versions, default=-1) >= min_version, timeout)
      self._raise_error()
      return max(self._versions, default=-1)

  def end_waits(self) -> None:
    """Every long poll, under way or to come, answers at once with the newest version: a Flight server's shutdown
    waits for the calls under way, which would otherwise hold it up to their whole wait."""
    with self._cond:
      self._waits_ended = True
      self._cond.notify_all()

  def get(self, version: int) -> tuple[list, list]:
    """(manifest, host arrays) of a held version; KeyError once it is no longer held."""
    with self._cond:
      self._raise_error()
      if version not in self._versions:
        raise KeyError(f"{VERSION_GONE}: {version} (have {sorted(self._versions)})")
      return self._versions[version]

  def where(self, version: int) -> dict | None:
    """Where each piece of a held version lies (None: the version is held whole)."""
    with self._cond:
      return self._where.get(version)

  def _raise_error(self) -> None:
    if self._error is not None:
      raise RuntimeError("moving the weights to the host failed") from self._error

  def wait(self) -> None:
    for thread in self._threads:
      thread.join()
    self.latest_version()


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """What the trainer's server takes and sends: a sample batch within `wire` (the run's `WireLimits`, or a vocabulary
  size alone), a DoPut waiting up to `put_wait_s` for room in a full queue, weights in chunks of `chunk_bytes`; of a
  trainer of several processes, the groups `owner` names (`step_plan.group_owner`)."""

  wire: WireLimits | int
  put_wait_s: float = 1.0
  chunk_bytes: int = DEFAULT_CHUNK_BYTES
  owner: tuple[int, int] = (0, 1)  # (this trainer process, the trainer's processes): whose groups it takes


@dataclasses.dataclass(slots=True, eq=False)
class ServerCounters(Counters):
  """A trainer door's batches and bytes taken and refused, weight streams served and actions."""

  accepted_batches: int = 0
  accepted_samples: int = 0
  accepted_bytes: int = 0
  duplicate_batches: int = 0
  bad_batches: int = 0
  full_refusals: int = 0
  rejoin_refusals: int = 0
  late_batches: int = 0
  trained_batches: int = 0
  weight_streams: int = 0
  weight_bytes: int = 0
  bad_tickets: int = 0
  actions: int = 0
  bad_actions: int = 0


class TrainerFlightServer(flight.FlightServerBase):
  """Serves samples, weights and control for one run; listening from construction, `shutdown()` to stop."""

  def __init__(self, host: str, port: int, *, controller, samples: SampleQueue, weights: HostWeightStore,
               limits: ServerLimits, tls: TLSFiles | None = None, arms=None):
    scheme = "grpc+tls" if tls else "grpc+tcp"
    super().__init__(f"{scheme}://{host}:{port}", **server_tls_options(tls))
    self.address = f"{host}:{self.port}"
    self.controller, self.samples, self.weights = controller, samples, weights
    self.door = controller.door if controller is not None else None  # judges each sample batch
    self.limits = limits.wire  # batch_to_shard's: the run's, or a vocabulary size alone
    self.put_wait_s, self.chunk_bytes = limits.put_wait_s, limits.chunk_bytes
    self._seq_locks: dict[int, threading.Lock] = {}
    self._last_seq: dict[int, int] = {}
    self._lock = threading.Lock()
    self.counters = ServerCounters()
    self._handlers = {VersionQuery: self._version_info}
    if controller is not None:  # None: a server of weights alone; a door of another process: of samples alone
      self._handlers.update(controller.handlers())
    self.owner = limits.owner  # (this trainer process, processes): a process takes the groups it owns alone
    self.arms = arms  # follower programs' streams (`pipeline.remote_arms.RemoteArms`), or None
    if arms is not None:
      self._handlers.update({ArmJoin: arms.join, ArmPoll: arms.poll})

  def shutdown(self) -> None:
    """Stops serving, once the calls under way have returned: the samplers' long polls for a newer version answer
    at once (they would hold the shutdown up to their wait, 5 s a sampler, 30 s a follower arm's)."""
    if self.weights is not None:
      self.weights.end_waits()
    super().shutdown()

  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self.counters.add(key, n)

  # ---- samples -------------------------------------------------------------------------------
  def do_put(self, context, descriptor, reader, writer):
    if descriptor.command != SAMPLES_COMMAND:
      raise flight.FlightServerError(f"DoPut takes the command {SAMPLES_COMMAND!r}, got {descriptor.command!r}")
    try:
      for chunk in reader:
        shard, envelope = batch_to_shard(chunk.data, self.limits)
        reply = self._accept(shard, envelope)
        if reply["status"] == "accepted":
          self._count("accepted_bytes", chunk.data.nbytes)
        writer.write(pa.py_buffer(json.dumps(reply).encode()))
    except flight.FlightError:  # the queue's backpressure, the run's end: as raised
      raise
    except (BadSampleBatch, BadShard, pa.ArrowException) as err:  # Arrow: a stream unlike the schema it announced
      self._count("bad_batches")
      reason = f"refused sample batch: {_bounded(err)}"
      if self.door is not None:
        self.door.shard_refused(reason)
      raise flight.FlightServerError(reason) from None

  def _accept(self, shard, envelope) -> dict:
    with self._lock:
      lock = self._seq_locks.setdefault(envelope.sampler_id, threading.Lock())
    with lock:  # a retry waits for an earlier attempt of the same sampler, then sees it as a duplicate
      if envelope.seq <= self._last_seq.get(envelope.sampler_id, -1):
        self._count("duplicate_batches")
        return {"seq": envelope.seq, "status": "duplicate"}
      process, processes = self.owner
      foreign = shard.group_ids[shard.group_ids % processes != process]
      if foreign.size:
        raise BadShard(f"group {int(foreign[0])} belongs to trainer process {int(foreign[0]) % processes}; this is "
                       f"process {process} of {processes}: send each group where the trainer's data_endpoints say")
      if shard.num_samples > self.samples.capacity:
        raise BadShard(f"{shard.num_samples} samples in one batch exceed the trainer's queue "
                       f"({self.samples.capacity} samples)")
      if self.door is not None:
        status = self.door.on_shard(envelope.sampler_id, shard)
        if status == "rejoin":  # a sampler of another run (the trainer restarted): not ours to train
          self._count("rejoin_refusals")
          return {"seq": envelope.seq, "status": "rejoin"}
        if status == "trained":  # its step is trained: another sampler's copy was taken
          self._count("trained_batches")
          self._last_seq[envelope.sampler_id] = envelope.seq
          return {"seq": envelope.seq, "status": "trained"}
        if status == "late":
          self._count("late_batches")
      try:
        self.samples.put(shard, timeout=self.put_wait_s)
      except TimeoutError:
        self._count("full_refusals")
        raise flight.FlightUnavailableError(f"sample queue full ({len(self.samples)}/{self.samples.capacity} "
                                            f"samples); retry") from None
      except QueueClosed:
        raise flight.FlightServerError("the trainer is no longer taking samples (run over)") from None
      self._last_seq[envelope.sampler_id] = envelope.seq
    self._count("accepted_batches")
    self._count("accepted_samples", shard.num_samples)
    return {"seq": envelope.seq, "status": "accepted"}

  # ---- weights -------------------------------------------------------------------------------
  def do_get(self, context, ticket):
    """Ticket `weight_chunks.weights_ticket(version, part, parts)`: the part's tensors of a held version; ticket
    `{"arm": NAME, "after": SEQ}`: that follower's retained shards numbered above SEQ."""
    if self.arms is not None and ticket.ticket.startswith(b'{"arm"'):
      return self._arm_stream(ticket.ticket)
    try:
      version, part, parts = read_weights_ticket(ticket.ticket)
      if version > self.weights.latest_version():  # a trainer process publishing a moment after process 0
        self.weights.wait_version(version, PIECES_WAIT_S)
      manifest, arrays = self.weights.get(version)
    except (ValueError, KeyError) as err:
      if VERSION_GONE not in str(err):
        self._count("bad_tickets")
      raise flight.FlightServerError(f"bad weights ticket {ticket.ticket[:QUOTE_CHARS]!r}: {_bounded(err)}") from None
    indices = part_indices(manifest, part, parts)
    self._count("weight_streams")
    self._count("weight_bytes", sum(arrays[i].nbytes for i in indices))
    schema = weight_schema(version, manifest, indices)
    where = self.weights.where(version)
    if where is not None:
      ours = {manifest[i][0]: where[manifest[i][0]] for i in indices}
      schema = schema.with_metadata({**schema.metadata, PIECES_KEY: encode_where(ours)})
    return flight.GeneratorStream(schema, weight_batches(schema, arrays, self.chunk_bytes))

  def _arm_stream(self, raw: bytes):
    """A follower's shards as sample batches, each stamped with its sequence number (the envelope's seq)."""
    try:
      ticket = json.loads(raw[:QUOTE_CHARS * 4])
      name, after = ticket["arm"], ticket["after"]
      if not isinstance(name, str) or not isinstance(after, int) or isinstance(after, bool):
        raise ValueError("'arm' must be a name and 'after' a sequence number")
      items = self.arms.read(name, after)
    except (ValueError, KeyError, TypeError, BadMessage) as err:
      self._count("bad_tickets")
      raise flight.FlightServerError(f"bad arm ticket {raw[:QUOTE_CHARS]!r}: {_bounded(err)}") from None
    return flight.GeneratorStream(SAMPLE_SCHEMA, (shard_to_batch(shard, SampleEnvelope(0, seq))
                                                  for seq, shard in items))

  def _version_info(self, query: VersionQuery) -> VersionInfo:
    """The newest version (a long poll), with where the asking sampler fetches it: its parent in the version's
    broadcast tree (`Controller.weight_source`), or "" for this server."""
    version = self.weights.wait_version(query.min_version, min(query.wait_s, 30.0))
    source = ""
    if self.controller is not None and query.sampler_id >= 0 and version >= 0:
      source = self.controller.weight_source(query.sampler_id, version)
    return VersionInfo(version, source)

  # ---- control -------------------------------------------------------------------------------
  def do_action(self, context, action):
    if action.type != "control":
      raise flight.FlightServerError(f"unknown action {action.type!r}; this server takes 'control'")
    self._count("actions")
    try:
      message = decode_message(action.body.to_pybytes())
      handler = self._handlers.get(type(message))
      if handler is None:
        raise BadMessage(f"this server does not take {type(message).__name__} messages")
      reply = handler(message)
    except BadMessage as err:
      self._count("bad_actions")
      raise flight.FlightServerError(_bounded(err)) from None
    return [flight.Result(pa.py_buffer(encode_message(reply)))]

  def list_actions(self, context):
    return [("control", "a JSON control message (streamrl_jax.messages) in, its reply out")]


def _bounded(err: Exception, limit: int = 500) -> str:
  """An error's text, cut so that no refusal carries much of what a peer sent (gRPC metadata is small)."""
  text = str(err)
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
