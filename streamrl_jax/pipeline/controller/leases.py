"""The leases handed out: who holds which (until its step is summarised), which each sampler has not reported,
the groups ever leased to each sampler (until their step is trained: the door takes no others from it), and
the groups leased again after a sampler was lost (until another delivers them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable, Sequence

from streamrl_jax.messages import Lease
from streamrl_jax.pipeline.controller.timeline import Timeline

Loss = tuple[float, str]  # when a sampler was declared lost (epoch seconds), its name


class Leases:
  """Lease ids count up from 0 in the order leases are granted."""

  def __init__(self, timeline: Timeline):
    self._timeline = timeline
    self._leases: dict[int, tuple[int, Lease]] = {}  # lease id -> (sampler id, lease)
    self._open: dict[int, set[int]] = {}  # sampler id -> lease ids it has not reported
    self._granted: dict[int, set] = {}  # sampler id -> (step, group id) ever leased to it, steps not yet trained
    self._re_leased: dict[tuple[int, int], Loss] = {}  # (step, group id) leased again -> the loss
    self._recovered: set[Loss] = set()  # losses whose groups another sampler delivered
    self._next = 0

  def grant(self, sampler_id: int, lease: Lease, instances: int) -> Lease:
    """`lease` given to `sampler_id`, numbered, carrying the instance target `instances`."""
    lease = dataclasses.replace(lease, lease_id=self._next, instances=instances)
    self._next += 1
    self._leases[lease.lease_id] = (sampler_id, lease)
    self._granted.setdefault(sampler_id, set()).update((lease.step, g) for g in lease.group_ids)
    self._open.setdefault(sampler_id, set()).add(lease.lease_id)
    self._timeline.count(leases=1)
    return lease

  def held(self, sampler_id: int, lease_id: int, step: int) -> Lease | None:
    """Lease `lease_id` when `sampler_id` was given it for `step` (None otherwise)."""
    owner, lease = self._leases.get(lease_id, (None, None))
    return lease if owner == sampler_id and lease.step == step else None

  def reported(self, sampler_id: int, lease_id: int) -> None:
    self._open.get(sampler_id, set()).discard(lease_id)

  def open_groups(self, sampler_id: int) -> set[int]:
    """The groups of the leases `sampler_id` has not reported."""
    return {g for lease_id in self._open.get(sampler_id, ()) for g in self._leases[lease_id][1].group_ids}

  def take_back(self, sampler_id: int, *, lost: bool) -> list[Lease]:
    """The leases `sampler_id` has not reported, in the order they were granted; they are no longer its (counted
    as leased again when it was `lost`)."""
    leases = [self._leases.pop(lease_id)[1] for lease_id in sorted(self._open.pop(sampler_id, ()))]
    self._timeline.count(re_leased_leases=len(leases) if lost else 0)
    return leases

  def forget(self, lease_ids: Iterable[int]) -> None:
    """Reported leases of a summarised step."""
    for lease_id in lease_ids:
      self._leases.pop(lease_id, None)

  def foreign(self, sampler_id: int, step: int, group_ids: Iterable[int]) -> list[int]:
    """Which of `group_ids` of `step` were never leased to `sampler_id`."""
    granted = self._granted.get(sampler_id, set())
    return [g for g in group_ids if (step, g) not in granted]

  def trained_below(self, version: int, live: Container[int]) -> None:
    """Steps below `version` are trained: their groups are forgotten (a sampler not `live` with nothing left,
    entirely)."""
    for sampler_id, granted in list(self._granted.items()):
      granted.difference_update({k for k in granted if k[0] < version})
      if not granted and sampler_id not in live:
        del self._granted[sampler_id]

  def lost(self, step: int, group_ids: Sequence[int], loss: Loss) -> None:
    """Groups of a lost sampler's lease, leased again."""
    self._re_leased.update({(step, g): loss for g in group_ids})
    self._timeline.count(re_leased_prompts=len(group_ids))

  def first_deliveries(self, step: int, group_ids: Iterable[int]) -> list[Loss]:
    """The losses whose leased-again groups were first delivered now (among `group_ids` of `step`)."""
    losses = {self._re_leased.pop((step, g)) for g in group_ids if (step, g) in self._re_leased}
    fresh = sorted(losses - self._recovered)
    self._recovered.update(fresh)
    return fresh
