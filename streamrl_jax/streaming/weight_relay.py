"""A sampler's relay of weight versions: what it receives, served on to its children in the broadcast tree
while it is still receiving it (chunk i goes on while chunk i+1 comes in).

`RelayStore` keeps the chunks of the newest versions as they arrive (the Arrow buffers themselves, no copy),
and `RelayServer` serves any part of a version from it over Arrow Flight DoGet, with the trainer's ticket and
stream format (`weight_chunks`) and the same mutual TLS. A version is served only while it is being received
or once it was received whole: a child asking for a version this relay does not hold (after a short wait for
it to begin), one it gave up, or one whose source failed mid-transfer, gets a refusal or a broken stream, and
fetches the version from another source. A child applies a version only once every byte of it arrived.
"""

from __future__ import annotations

import dataclasses
import threading

import pyarrow as pa
import pyarrow.flight as flight

from streamrl_jax.counters import Counters
from streamrl_jax.streaming.flight_server import TLSFiles, server_tls_options
from streamrl_jax.streaming.weight_chunks import (BadWeightStream, chunk_batch, part_indices, read_weights_ticket,
                                                  tensor_nbytes, weight_schema)


class RelayRefused(LookupError):
  """This relay cannot serve the version asked for."""


@dataclasses.dataclass
class _Version:
  manifest: list
  rows: list = dataclasses.field(default_factory=list)  # (tensor index, offset, Arrow buffer), as they arrived
  state: str = "receiving"  # or "complete", "failed"
  reason: str = ""
  held: dict = dataclasses.field(default_factory=dict)  # tensor index -> bytes of it held (from its start)


class RelayStore:
  """The versions a sampler receives, kept for its children: `begin`, `add` each chunk, then `complete` or
  `fail`; `stream` serves one part of one version. Thread-safe. Keeps the newest `keep` versions (default one:
  a relay holds one copy of the model on the host besides what it runs).

  Chunks of a tensor are kept in order from its first byte: a chunk already held is skipped, so when this
  sampler's own source fails and it fetches the version again elsewhere, the streams it serves go on where they
  were instead of breaking (the chunking is the trainer's, whoever forwards it). A chunk that would leave a gap
  fails the version."""

  def __init__(self, *, keep: int = 1, begin_wait_s: float = 10.0, stall_s: float = 60.0):
    self.keep, self.begin_wait_s, self.stall_s = keep, begin_wait_s, stall_s
    self._cond = threading.Condition()
    self._versions: dict[int, _Version] = {}
    self._closed = False
    self.served_bytes = 0  # chunk bytes handed to the streams it serves (written under the lock)

  def begin(self, version: int, manifest: list) -> None:
    """Announces a version (once per stream of it: the manifests must agree); a failed one starts afresh."""
    with self._cond:
      held = self._versions.get(version)
      if held is not None and held.state != "failed":
        if held.manifest != manifest:
          raise BadWeightStream(f"version {version} arrived with two different manifests")
        return
      self._versions[version] = _Version(manifest)
      for old in sorted(self._versions)[:-self.keep]:
        del self._versions[old]
      self._cond.notify_all()

  def add(self, version: int, index: int, offset: int, data: pa.Buffer) -> None:
    with self._cond:
      held = self._versions.get(version)
      if held is None or held.state != "receiving":
        return
      have = held.held.get(index, 0)
      if offset + data.size <= have and (offset, data.size) != (0, 0):  # held already (a fetch started again)
        return
      if offset != have:
        held.state, held.reason = "failed", f"chunk at byte {offset} of tensor {index}, {have} bytes held"
      else:
        held.rows.append((index, offset, data))
        held.held[index] = have + data.size
      self._cond.notify_all()

  def complete(self, version: int) -> None:
    """Every stream of the version arrived: serve it as held (failed instead if a byte is missing)."""
    with self._cond:
      held = self._versions.get(version)
      missing = held is not None and any(held.held.get(i, 0) != n for i, n in enumerate(tensor_nbytes(held.manifest)))
    self._settle(version, "failed" if missing else "complete", "bytes missing at completion" if missing else "")

  def close(self) -> None:
    """Fails every version still arriving and refuses new streams (the sampler stops)."""
    with self._cond:
      self._closed = True
      for held in self._versions.values():
        if held.state == "receiving":
          held.state, held.reason = "failed", "the relay is stopping"
      self._cond.notify_all()

  def fail(self, version: int, reason: str) -> None:
    """The version's source failed: streams of it under way break, new ones are refused."""
    self._settle(version, "failed", reason)

  def _settle(self, version: int, state: str, reason: str) -> None:
    with self._cond:
      held = self._versions.get(version)
      if held is not None and held.state == "receiving":
        held.state, held.reason = state, reason
        self._cond.notify_all()

  def holds(self) -> dict[int, str]:
    with self._cond:
      return {v: h.state for v, h in self._versions.items()}

  def stream(self, version: int, part: int, parts: int) -> tuple[pa.Schema, object]:
    """(schema, batches) of one part of `version`, served as its chunks arrive. Refused (`RelayRefused`)
    when the version does not begin arriving within `begin_wait_s`, or its source failed."""
    with self._cond:
      self._cond.wait_for(lambda: self._closed or version in self._versions
                          or max(self._versions, default=-1) > version, self.begin_wait_s)
      if self._closed:
        raise RelayRefused("this relay is stopping")
      held = self._versions.get(version)
      if held is None or held.state == "failed":
        why = "its source failed: " + held.reason[:200] if held is not None else f"holds {sorted(self._versions)}"
        raise RelayRefused(f"this relay does not hold version {version} ({why})")
    indices = part_indices(held.manifest, part, parts)
    return weight_schema(version, held.manifest, indices), self._batches(version, held, indices)

  def _batches(self, version: int, held: _Version, indices: list[int]):
    schema = weight_schema(version, held.manifest, indices)
    wanted, nbytes = set(indices), tensor_nbytes(held.manifest)
    left, seen = sum(nbytes[i] for i in indices), 0
    while left > 0:
      with self._cond:
        moved = self._cond.wait_for(lambda: len(held.rows) > seen or held.state != "receiving", self.stall_s)
        if held.state == "failed":
          raise flight.FlightServerError(f"relay lost the source of version {version} mid-transfer: {held.reason[:200]}")
        if not moved:
          raise flight.FlightServerError(f"relay: no chunk of version {version} for {self.stall_s:.0f} s")
        rows, seen = held.rows[seen:], len(held.rows)
        if not rows and held.state == "complete":
          raise flight.FlightServerError(f"relay: version {version} completed without {left} bytes of this part")
      for index, offset, data in rows:
        if index in wanted:
          left -= data.size
          with self._cond:
            self.served_bytes += data.size
          yield chunk_batch(schema, index, offset, data)


@dataclasses.dataclass(slots=True, eq=False)
class RelayCounters(Counters):
  """Weight streams a relay served and refused."""

  relay_streams: int = 0
  relay_refusals: int = 0


class RelayServer(flight.FlightServerBase):
  """Serves a `RelayStore` by DoGet (the trainer's weights tickets); listening from construction.
  `address` is what children dial: `advertise` (a host) with the bound port, or the listen host."""

  def __init__(self, host: str, port: int, store: RelayStore, *, tls: TLSFiles | None = None,
               advertise: str | None = None):
    super().__init__(f"{'grpc+tls' if tls else 'grpc+tcp'}://{host}:{port}", **server_tls_options(tls))
    if not advertise and host in ("0.0.0.0", "::", "[::]", ""):
      raise ValueError(f"--relay-listen {host}:{port} binds every interface: give --relay-host, the address "
                       f"other samplers dial")
    self.address = f"{advertise or host}:{self.port}"
    self.store = store
    self._lock = threading.Lock()
    self.counters = RelayCounters()

  def shutdown(self) -> None:
    self.store.close()  # streams waiting for chunks end now, so the server's shutdown does not wait on them
    super().shutdown()

  def do_get(self, context, ticket):
    try:
      version, part, parts = read_weights_ticket(ticket.ticket)
      schema, batches = self.store.stream(version, part, parts)
    except (ValueError, RelayRefused) as err:
      with self._lock:
        self.counters.relay_refusals += 1
      raise flight.FlightServerError(str(err)[:500]) from None
    with self._lock:
      self.counters.relay_streams += 1
    return flight.GeneratorStream(schema, batches)
