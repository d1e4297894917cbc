"""The OpenAI-compatible server's configuration: where it listens, who may call it, and what one call may ask."""

from __future__ import annotations

import dataclasses

PRIORITIES = ("before_leases", "after_leases")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Where the server listens, its key and its bounds."""

  host: str = "127.0.0.1"  # address to listen on ("0.0.0.0": every interface)
  port: int = 8000  # port to listen on (0: a free one, chosen at start)
  api_key: str = ""  # callers must send `Authorization: Bearer KEY`; "": no key (env STREAMRL_API_KEY sets it)
  model_name: str = ""  # the model id `/v1/models` lists and requests name; "": the --model given
  max_requests: int = 256  # requests accepted at once (queued or generating); more are answered 429
  max_tokens: int = 0  # most tokens one completion may ask for; 0: the engine's bound (EngineConfig.max_new_tokens)
  max_body_bytes: int = 1 << 20  # largest request body; larger is answered 413
  max_n: int = 16  # most choices (`n`) per request
  # served requests and a sampler's leases share its engine: "before_leases" admits a request ahead of queued
  # lease requests, "after_leases" only while none waits
  priority: str = "before_leases"
  request_timeout_s: float = 600.0  # a request generating longer than this is cancelled (504)
  temperature: float = -1.0  # >= 0: every request samples at this temperature, whatever it asks (0: greedy)

  def __post_init__(self):
    if not 0 <= self.port < 65536:
      raise ValueError(f"ServeConfig.port={self.port} must be in [0, 65535]")
    for name in ("max_requests", "max_body_bytes", "max_n"):
      if getattr(self, name) < 1:
        raise ValueError(f"ServeConfig.{name}={getattr(self, name)} must be >= 1")
    if self.max_tokens < 0:
      raise ValueError(f"ServeConfig.max_tokens={self.max_tokens} must be >= 0 (0: the engine's bound)")
    if self.priority not in PRIORITIES:
      raise ValueError(f"ServeConfig.priority={self.priority!r}; known: {list(PRIORITIES)}")
    if self.request_timeout_s <= 0:
      raise ValueError(f"ServeConfig.request_timeout_s={self.request_timeout_s} must be > 0")
