"""How the trainer and its samplers reach each other across processes: timeouts of the Flight link and
the address format of `--listen` / `--connect`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FlightConfig:
  """How the trainer and its samplers reach each other across processes."""

  heartbeat_s: float = 2.0  # a sampler's heartbeat period
  lease_timeout_s: float = 10.0  # a sampler silent this long is declared lost; its leases go to the others
  call_timeout_s: float = 60.0  # deadline of one call
  connect_retry_s: float = 300.0  # how long a sampler keeps trying to reach the trainer (a warm-up, a restart)
  sampler_timeout_s: float = 600.0  # the trainer gives up when no sampler has been heard from for this long
  finish_grace_s: float = 15.0  # after the last step: how long the trainer waits for samplers to learn it
  weight_fanout: int = 1  # children per node of a version's broadcast tree (1: a chain, best when links are equal)
  weight_streams: int = 4  # parallel DoGet streams per weight fetch, each a part of the tensors
  weight_chunk_mb: int = 32  # a tensor travels in chunks of at most this; a relay forwards a chunk once it has it

  def __post_init__(self):
    if self.weight_streams > 64:
      raise ValueError(f"FlightConfig.weight_streams must be <= 64, got {self.weight_streams}")
    for field in dataclasses.fields(self):
      if getattr(self, field.name) <= 0:
        raise ValueError(f"FlightConfig.{field.name} must be > 0, got {getattr(self, field.name)}")
    if self.lease_timeout_s <= self.heartbeat_s:
      raise ValueError(f"FlightConfig.lease_timeout_s ({self.lease_timeout_s}) must exceed heartbeat_s "
                       f"({self.heartbeat_s}), or every sampler would be declared lost between two beats")


def parse_address(address: str, flag: str) -> tuple[str, int]:
  """(host, port) of `HOST:PORT`; a malformed address is refused naming `flag`."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{flag} {address!r}: expected HOST:PORT (port 0 picks a free one)")
  return host, int(port)
