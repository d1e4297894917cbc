"""A sampler's side of the Arrow Flight transport: the control channel, the sample sender and the weight
receiver, over one `FlightConnection` (mutual TLS optional, a deadline on every call, bounded retries while
the trainer cannot be reached).

`FlightControl` answers the same calls as the in-process `Controller` (register, lease, report, heartbeat,
leave); `FlightSampleSender.put` is the sample transport's put; `FlightWeightReceiver` is a `WeightSource`
that fetches each new version in the background and places it onto the sampler's own mesh and shardings.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from streamrl_jax.counters import Counters
from streamrl_jax import launch
from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import (Ack, BadMessage, Heartbeat, HeartbeatReply, LeaseReply, LeaseRequest, Leave,
                                   Register, Registered, RejoinRequired, StepReport, VersionInfo, VersionQuery,
                                   WeightUpdate)
from streamrl_jax.pytrees import flatten_with_names, unflatten_like
from streamrl_jax.streaming.flight_server import SAMPLES_COMMAND, VERSION_GONE, TLSFiles
from streamrl_jax.streaming.sample_schema import SAMPLE_SCHEMA, SampleEnvelope, shard_to_batch
from streamrl_jax.streaming.weight_chunks import (BadWeightStream, DEFAULT_CHUNK_BYTES, WeightAssembler,
                                                  check_tensors, chunk_rows, manifest_of, part_indices, read_manifest,
                                                  weights_ticket)
from streamrl_jax.streaming.weight_pieces import PIECES_KEY, assemble, decode_where
from streamrl_jax.streaming.weight_relay import RelayStore
from streamrl_jax.streaming.weights import LatestWeights

_log = logging.getLogger(__name__)


RETRY_NOTICE_S = 20.0
WEIGHTS_DEADLINE_S = 1800.0  # one weight stream's deadline: a version over a slow link takes minutes


class TrainerUnreachable(ConnectionError):
  """The trainer's server did not answer for longer than the configured limit."""


def _message(err: Exception) -> str:
  return str(err).split(". Detail:")[0]


@dataclasses.dataclass(slots=True, eq=False)
class ConnectionCounters(Counters):
  """A connection's calls and their retries."""

  flight_calls: int = 0
  flight_retries: int = 0


class FlightConnection:
  """A client of the trainer's server. Every call has a deadline (`timeout_s`, or the call's own); calls
  that find the server unavailable are retried with backoff for up to `retry_s` seconds in all."""

  def __init__(self, address: str, *, tls: TLSFiles | None = None, timeout_s: float = 60.0, retry_s: float = 120.0,
               peer: str = "the trainer", tls_name: str | None = None):
    """`peer` names the other side in errors; `tls_name`: the name its certificate must carry (default: the
    host dialled), e.g. a relay dialled at a pod IP whose certificate names a service."""
    if ":" not in address:
      raise ValueError(f"--connect {address!r}: expected HOST:PORT")
    self.address, self.timeout_s, self.retry_s, self.peer = address, timeout_s, retry_s, peer
    self.tls = tls is not None
    kwargs = {}
    if tls is not None:
      cert, key, ca = tls.read()
      kwargs = dict(tls_root_certs=ca, cert_chain=cert, private_key=key)
      if tls_name:
        kwargs["override_hostname"] = tls_name
    self.client = flight.FlightClient(f"{'grpc+tls' if tls else 'grpc+tcp'}://{address}", **kwargs)
    self.counters = ConnectionCounters()
    self._closed = threading.Event()

  def options(self, timeout: float | None = None) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(timeout=timeout or self.timeout_s)

  def call(self, fn, *, retry_s: float | None = None, abort: threading.Event | None = None):
    """fn() with retries while the server is unavailable (refusing connections, restarting, or asking for a
    retry); raises TrainerUnreachable after `retry_s` seconds, ConnectionError once the connection is closed or
    `abort` is set (the session the call belongs to ended: a trainer that shut down is not waited for)."""
    limit = self.retry_s if retry_s is None else retry_s
    start, pause, said = time.monotonic(), 0.05, 0.0
    while True:
      if self._closed.is_set():
        raise ConnectionError(f"the connection to {self.address} is closed")
      if abort is not None and abort.is_set():
        raise ConnectionError(f"a call to {self.address} abandoned: the session it served has ended")
      self.counters.flight_calls += 1
      try:
        return fn()
      except (flight.FlightUnavailableError, flight.FlightTimedOutError) as err:
        if time.monotonic() - start + pause > limit:
          raise TrainerUnreachable(f"{self.peer} at {self.address} did not take the call for {limit:.0f} s: "
                                   f"{_message(err)}{self._tls_hint(err)}") from None
        waited = time.monotonic() - start
        if waited - said >= RETRY_NOTICE_S:  # a warm-up or a restart: say so now and then
          said = waited
          _log.info(f"{self.peer} at {self.address} is not answering yet ({waited:.0f} s: {_message(err)}); "
                    f"retrying for up to {limit:.0f} s in all")
      self.counters.flight_retries += 1
      (abort or self._closed).wait(pause)
      pause = min(2 * pause, 2.0)

  def _tls_hint(self, err: Exception) -> str:
    """gRPC reports a refused TLS handshake as a closed socket; say what to check."""
    text = str(err).lower()
    if not self.tls or not any(w in text for w in ("socket closed", "handshake", "ssl", "certificate")):
      return ""
    return ("; the TLS handshake failed: the trainer must trust this sampler's --tls-cert (signed by the trainer's "
            "--tls-ca) and this sampler's --tls-ca must sign the trainer's certificate, for the host it dials")

  def action(self, message, reply_type: type, timeout: float | None = None, retry_s: float | None = None,
             abort: threading.Event | None = None):
    def once():
      action = flight.Action("control", encode_message(message))
      try:
        results = list(self.client.do_action(action, options=self.options(timeout)))
      except flight.FlightServerError as err:
        raise BadMessage(f"{self.peer} refused {type(message).__name__}: {_message(err)}") from None
      return decode_message(results[0].body.to_pybytes(), reply_type)
    return self.call(once, retry_s=retry_s, abort=abort)

  def close(self) -> None:
    """Ends retries at once; calls under way run to their deadline."""
    self._closed.set()


class FlightControl:
  """The control channel of a `SamplerWorker` across processes."""

  def __init__(self, connection: FlightConnection):
    self.connection = connection

  def register(self, message: Register) -> Registered:
    return self.connection.action(message, Registered)

  def lease(self, message: LeaseRequest) -> LeaseReply:
    return self.connection.action(message, LeaseReply, timeout=message.wait_s + self.connection.timeout_s)

  def report(self, message: StepReport) -> Ack:
    return self.connection.action(message, Ack)

  def heartbeat(self, message: Heartbeat, abort: threading.Event | None = None) -> HeartbeatReply:
    """`abort`: the session's end, which ends the retries of a beat to a trainer that has gone."""
    return self.connection.action(message, HeartbeatReply, abort=abort)

  def leave(self, message: Leave) -> Ack:
    """Best effort at the end of a run: a few seconds of retries, not the full connect limit."""
    return self.connection.action(message, Ack, timeout=5.0, retry_s=5.0)


class FlightSampleSender:
  """`put(shard)` sends one shard per DoPut with the next sequence number and waits for its ack; a refusal
  because the trainer's queue is full is retried for as long as it lasts (backpressure), an unreachable
  trainer up to the connection's retry limit. The shard is never dropped: put returns once it is acked, or
  raises `RejoinRequired` when the trainer does not know this sampler (its lease is to be dropped)."""

  def __init__(self, connection: FlightConnection, sampler_id: int):
    self.connection, self.sampler_id, self.seq = connection, sampler_id, 0
    self.stats = dict(put_shards=0, put_samples=0, duplicate_acks=0, trained_acks=0, full_retries=0,
                      put_wait_s=0.0, refused_shards=0)

  def put(self, shard, timeout: float | None = None) -> None:
    batch = shard_to_batch(shard, SampleEnvelope(self.sampler_id, self.seq))
    start = time.perf_counter()
    while True:
      try:
        ack = self.connection.call(lambda: self._send(batch, timeout))
        break
      except _QueueFull:
        self.stats["full_retries"] += 1
        time.sleep(0.01)
    self.stats["put_wait_s"] += time.perf_counter() - start
    if ack.get("seq") != self.seq:
      raise BadMessage(f"the trainer acknowledged sequence number {ack.get('seq')}, expected {self.seq}")
    if ack.get("status") == "rejoin":
      self.stats["refused_shards"] += 1
      raise RejoinRequired(f"the trainer at {self.connection.address} does not know sampler {self.sampler_id}")
    self.stats["duplicate_acks"] += ack.get("status") == "duplicate"
    self.stats["trained_acks"] += ack.get("status") == "trained"  # another sampler's copy was trained
    self.stats["put_shards"] += 1
    self.stats["put_samples"] += shard.num_samples
    self.seq += 1

  def _send(self, batch: pa.RecordBatch, timeout: float | None) -> dict:
    descriptor = flight.FlightDescriptor.for_command(SAMPLES_COMMAND)
    try:
      writer, reader = self.connection.client.do_put(descriptor, SAMPLE_SCHEMA, options=self.connection.options(timeout))
      with writer:
        writer.write_batch(batch)
        writer.done_writing()
        ack = reader.read()
    except flight.FlightUnavailableError as err:
      if "queue full" in str(err):
        raise _QueueFull() from None
      raise
    except flight.FlightServerError as err:
      raise BadMessage(_message(err)) from None
    return json.loads(ack.to_pybytes())


class _QueueFull(Exception):
  pass


class VersionGone(LookupError):
  """The trainer no longer holds the weights of this version (it published newer ones, or restarted)."""


def fetch_weights(connection: FlightConnection, version: int, expected: dict | None = None, streams: int = 2,
                  sink: RelayStore | None = None, doors: tuple[FlightConnection, ...] = ()) -> tuple[int, dict, int]:
  """(version, {name: host array}, bytes) of one version, fetched as `streams` parallel DoGets of disjoint parts
  from `connection` (the trainer, or a relay); `expected` ({name: shape}) checks the tensors against the
  receiver's model. With a `sink` (this sampler's relay), every chunk is also handed on as it arrives and the
  version is marked whole at the end; on failure the sink is left as it is (the caller may fetch again from
  elsewhere into it, or fail it). With `doors` (a trainer of several processes: the others' doors), each process's
  pieces come from its own door and are assembled here (`weight_pieces`); the sink then gets the whole version."""
  holders = (connection,) + tuple(doors)
  jobs = [(door, i) for door in holders for i in range(streams)]
  streamed = sink if not doors else None
  with ThreadPoolExecutor(len(jobs), thread_name_prefix="weights-fetch") as pool:
    results = list(pool.map(lambda job: job[0].call(lambda: _fetch_part(job[0], version, job[1], streams, streamed)),
                            jobs))
  flat = {name: array for arrays, _, _ in results for name, array in arrays.items()}
  where = {piece: place for _, _, places in results if places for piece, place in places.items()}
  if where:
    flat = assemble(flat, where)
  if expected is not None:
    check_tensors(flat, expected)
  if sink is not None:
    if streamed is None:
      _hand_on(sink, version, flat)
    sink.complete(version)
  return version, flat, sum(r[1] for r in results)


def _fetch_part(connection: FlightConnection, version: int, i: int, streams: int, sink: RelayStore | None):
  """({name: array}, bytes, where each piece lies or None) of part `i` of `streams` of a version at `connection`."""
  added = False
  try:
    reader = connection.client.do_get(flight.Ticket(weights_ticket(version, i, streams)),
                                      options=connection.options(max(connection.timeout_s, WEIGHTS_DEADLINE_S)))
    got, manifest, indices = read_manifest(reader.schema)
    if got != version or indices != part_indices(manifest, i, streams):
      raise BadWeightStream(f"asked for part {i} of {streams} of version {version}, got {len(indices)} tensors "
                            f"of version {got}")
    if sink is not None:
      sink.begin(version, manifest)
    assembler = WeightAssembler(manifest, indices)
    for chunk in reader:
      for index, offset, data in chunk_rows(chunk.data):
        assembler.place(index, offset, data)
        if sink is not None:
          sink.add(version, index, offset, data)
          added = True
    arrays = assembler.result()
    raw = (reader.schema.metadata or {}).get(PIECES_KEY)
    return arrays, assembler.bytes, decode_where(raw, arrays) if raw is not None else None
  except flight.FlightServerError as err:
    if VERSION_GONE in str(err):
      raise VersionGone(version) from None
    raise BadMessage(f"fetching weights of version {version} from {connection.address}: {_message(err)}") from None
  except (flight.FlightUnavailableError, flight.FlightTimedOutError) as err:
    if added:  # chunks went on to this sampler's children: a retry would repeat them
      raise BadMessage(f"the stream of version {version} from {connection.address} broke: {_message(err)}") from None
    raise


def _hand_on(sink: RelayStore, version: int, flat: dict) -> None:
  """A version assembled here, handed whole to this sampler's relay (in chunks of the usual size)."""
  manifest = manifest_of(flat)
  sink.begin(version, manifest)
  for index, array in enumerate(flat.values()):
    data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    for offset in range(0, max(len(data), 1), DEFAULT_CHUNK_BYTES):
      sink.add(version, index, offset, pa.py_buffer(data[offset:offset + DEFAULT_CHUNK_BYTES]))


@dataclasses.dataclass(frozen=True)
class RelayLinks:
  """A weight receiver's links besides the trainer's server: the relay `store` it fills for the samplers below it
  (None: it serves none), the TLS files and certificate name (`tls_name`, when not the address dialled) for reaching
  the relays above it, and the `doors` of a trainer's other processes (each serves its own pieces of a version)."""

  store: RelayStore | None = None
  tls: TLSFiles | None = None
  tls_name: str | None = None
  doors: tuple[FlightConnection, ...] = ()


class FlightWeightReceiver:
  """A `WeightSource` across processes: a background thread waits for each newer version (a long poll),
  fetches its chunks by DoGet from where the trainer says (its parent relay in the version's broadcast tree,
  falling back to the trainer when that fails), checks them against `template` (the model's parameter
  structure), and places them with `shardings` (the sampler mesh's). With a `relay` store, what arrives is
  served on to this sampler's children as it comes. `latest()` never touches the network."""

  def __init__(self, connection: FlightConnection, template, shardings, *, poll_s: float | None = 5.0, finish=None,
               sampler_id: int = -1, relays: RelayLinks = RelayLinks(), streams: int = 2):
    """`finish(placed) -> parameters` runs on what landed (a precision's `Landing.finish`; default: as is). `poll_s`
    None: no background thread polls; versions come only when asked for (`fetch`), and nothing else writes the relay."""
    self.connection, self.template, self.shardings, self.poll_s = connection, template, shardings, poll_s
    self.sampler_id, self.relay, self.tls, self.streams = sampler_id, relays.store, relays.tls, streams
    self.relay_tls_name, self.doors = relays.tls_name, relays.doors
    self._sources: dict[str, FlightConnection] = {}
    self.last_fallback = ""
    self.held_at: dict[int, float] = {}  # version -> time.time() it landed
    self._finish = finish or (lambda placed: placed)
    self._expected = {k: tuple(np.shape(v)) for k, v in flatten_with_names(template).items()}
    self._held = LatestWeights(f"receiving weights from {connection.address} failed")
    self._stop = threading.Event()
    self.stats = dict(fetches=0, bytes=0, fetch_s=0.0, relay_fetches=0, relay_fallbacks=0)
    self._thread = threading.Thread(target=self._loop, daemon=True, name="weight-receiver")
    if poll_s is not None:
      self._thread.start()

  def _loop(self) -> None:
    try:
      while not self._stop.is_set():
        have = self._held.version
        info = self.connection.action(VersionQuery(min_version=have + 1, wait_s=self.poll_s,
                                                   sampler_id=self.sampler_id), VersionInfo,
                                      timeout=self.poll_s + self.connection.timeout_s, abort=self._stop)
        if self._stop.is_set():  # closed during the poll: nothing more is fetched or placed
          return
        if info.version > have:
          try:
            update = self.fetch(info.version, info.source)
          except VersionGone:  # superseded between the query and the fetch: ask again
            continue
          self._held.offer(update)
    except BaseException as err:  # surfaced by latest()/wait_for(), unless the receiver was closed
      self._held.fail(None if self._stop.is_set() else err)

  def fetch(self, version: int, source: str = "") -> WeightUpdate:
    """One version by DoGet from `source` (a relay; "": the trainer), placed onto the sampler's shardings. A
    relay that refuses, breaks off or sends what does not add up: the version is fetched whole from the trainer."""
    start = time.perf_counter()
    got = None
    if source:
      try:
        got, flat, nbytes = fetch_weights(self._source(source), version, self._expected, self.streams, self.relay)
        self.stats["relay_fetches"] += 1
      except Exception as err:  # noqa: BLE001 - whatever went wrong there, the trainer has the version
        self.stats["relay_fallbacks"] += 1
        self.last_fallback = f"{type(err).__name__}: {_message(err)[:300]}"
        _log.warning(f"weights of version {version} from relay {source} failed ({self.last_fallback}); "
                     f"fetching them from the trainer (the samplers below this one go on from what it holds)")
    if got is None:
      try:
        got, flat, nbytes = fetch_weights(self.connection, version, self._expected, self.streams, self.relay,
                                          self.doors)
      except BaseException as err:
        if self.relay is not None:
          self.relay.fail(version, f"{type(err).__name__}: {_message(err)[:200]}")
        raise
    params = launch.put(unflatten_like(self.template, flat, "the weight stream"), self.shardings)
    params = jax.block_until_ready(self._finish(params))
    self.stats["fetches"] += 1
    self.stats["bytes"] += nbytes
    self.stats["fetch_s"] += time.perf_counter() - start
    self.held_at[got] = time.time()
    for old in sorted(self.held_at)[:-8]:
      del self.held_at[old]
    return WeightUpdate(got, params)

  def _source(self, address: str) -> FlightConnection:
    """A connection to a relay: short retries, since the trainer is there to fall back to."""
    if address not in self._sources:
      self._sources[address] = FlightConnection(address, tls=self.tls, timeout_s=self.connection.timeout_s,
                                                retry_s=2.0, peer="the relay", tls_name=self.relay_tls_name)
    return self._sources[address]

  def latest(self) -> WeightUpdate | None:
    return self._held.latest()

  def wait_for(self, version: int, timeout: float | None = None) -> WeightUpdate:
    return self._held.wait_for(version, timeout)

  def close(self) -> None:
    """Stops the receiver and waits for its thread: a long poll under way ends when a newer version comes or the
    trainer shuts down (at most `poll_s`), and is not fetched. A Flight call cannot be cancelled from here, and a
    thread left inside one when the process exits aborts it ("terminate called ... exception not rethrown")."""
    self._stop.set()
    for source in self._sources.values():
      source.close()
    if self._thread.ident is not None:  # started (`poll_s`)
      self._thread.join(timeout=self.poll_s + self.connection.timeout_s)
    for source in self._sources.values():
      source.client.close()
