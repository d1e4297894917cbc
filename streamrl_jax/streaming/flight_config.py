"""How the trainer and its samplers reach each other across processes: the Flight link's calls and weight
streams, and the address format of `--listen` / `--connect` (the controller's own timeouts are
`pipeline.controller.config.ControllerConfig`, the same in one process)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FlightConfig:
  """How the trainer and its samplers reach each other across processes."""

  call_timeout_s: float = 60.0  # deadline of one call
  connect_retry_s: float = 300.0  # how long a sampler keeps trying to reach the trainer (a warm-up, a restart)
  weight_streams: int = 4  # parallel DoGet streams per weight fetch, each a part of the tensors
  weight_chunk_mb: int = 32  # a tensor travels in chunks of at most this; a relay forwards a chunk once it has it

  def __post_init__(self):
    if self.weight_streams > 64:
      raise ValueError(f"FlightConfig.weight_streams must be <= 64, got {self.weight_streams}")
    for field in dataclasses.fields(self):
      if getattr(self, field.name) <= 0:
        raise ValueError(f"FlightConfig.{field.name} must be > 0, got {getattr(self, field.name)}")


def parse_address(address: str, flag: str) -> tuple[str, int]:
  """(host, port) of `HOST:PORT`; a malformed address is refused naming `flag`."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{flag} {address!r}: expected HOST:PORT (port 0 picks a free one)")
  return host, int(port)
