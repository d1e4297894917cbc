"""The controller's record of the run: its events (samplers joining, leaving, lost; leases given again; weight
trees; groups filtered and regenerated), the samplers' busy spans and the counters. Every part writes here."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from streamrl_jax.counters import Counters


@dataclasses.dataclass(slots=True, eq=False)
class ControllerCounters(Counters):
  """The controller's record of samplers, leases, samples and refusals."""

  registered: int = 0
  leases: int = 0
  reports: int = 0
  prompts_submitted: int = 0
  samples_generated: int = 0
  sampler_wait_s: float = 0.0
  samplers_left: int = 0
  samplers_lost: int = 0
  re_leased_leases: int = 0
  re_leased_prompts: int = 0
  groups_kept: int = 0
  late_samples: int = 0
  late_reports: int = 0
  rejoin_requests: int = 0
  trained_refusals: int = 0
  refused_batches: int = 0
  prompts_backfilled: int = 0
  groups_regenerated: int = 0
  partial_samples_handed_back: int = 0


class Timeline:
  """Events in epoch seconds (each also handed to `on_event`), busy spans per sampler name, counters by name."""

  def __init__(self, on_event: Callable[[dict], None] | None = None):
    self.events: list[dict] = []
    self.busy: dict[str, list] = {}  # sampler name -> [(start, end, label)] in epoch seconds
    self.counters = ControllerCounters()
    self._on_event = on_event

  def event(self, kind: str, **fields) -> None:
    event = dict(event=kind, t=time.time(), **fields)
    self.events.append(event)
    if self._on_event is not None:
      self._on_event(event)

  def count(self, **amounts: float) -> None:
    for name, amount in amounts.items():
      self.counters.add(name, amount)

  def spans(self, name: str, spans: Iterable[tuple[float, float]], label: str) -> None:
    self.busy.setdefault(name, []).extend((b, e, label) for b, e in spans)

  def per_sampler(self, name: str) -> float:
    """Counter `name` per sampler ever registered."""
    return self.counters[name] / max(1, self.counters.registered)
