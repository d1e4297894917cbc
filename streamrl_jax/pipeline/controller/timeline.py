"""The controller's record of the run: its events (samplers joining, leaving, lost; leases given again; weight
trees; groups filtered and regenerated), the samplers' busy spans and the counters. Every part writes here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


def _fresh_counters() -> dict:
  return dict(registered=0, leases=0, reports=0, prompts_submitted=0, samples_generated=0, sampler_wait_s=0.0,
              samplers_left=0, samplers_lost=0, re_leased_leases=0, re_leased_prompts=0, groups_kept=0, late_samples=0,
              late_reports=0, rejoin_requests=0, trained_refusals=0, refused_batches=0, prompts_backfilled=0,
              groups_regenerated=0, partial_samples_handed_back=0)


class Timeline:
  """Events in epoch seconds (each also handed to `on_event`), busy spans per sampler name, counters by name."""

  def __init__(self, on_event: Callable[[dict], None] | None = None):
    self.events: list[dict] = []
    self.busy: dict[str, list] = {}  # sampler name -> [(start, end, label)] in epoch seconds
    self.counters = _fresh_counters()
    self._on_event = on_event

  def event(self, kind: str, **fields) -> None:
    event = dict(event=kind, t=time.time(), **fields)
    self.events.append(event)
    if self._on_event is not None:
      self._on_event(event)

  def count(self, **amounts: float) -> None:
    for name, amount in amounts.items():
      self.counters[name] += amount

  def spans(self, name: str, spans: Iterable[tuple[float, float]], label: str) -> None:
    self.busy.setdefault(name, []).extend((b, e, label) for b, e in spans)

  def per_sampler(self, name: str) -> float:
    """Counter `name` per sampler ever registered."""
    return self.counters[name] / max(1, self.counters["registered"])
