"""The samplers' roster: who is registered (name, site, relay, when last heard from), who was declared lost,
whether the run is over, and the instance target the next leases carry (the elastic rule). Sampler ids are
random, so a sampler of a trainer that restarted is unknown here."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from streamrl_jax.messages import BadMessage, Register, StepSummary, quote
from streamrl_jax.pipeline.controller.timeline import Timeline
from streamrl_jax.scheduling import SchedulingConfig
from streamrl_jax.streaming.flight_config import parse_address


@dataclasses.dataclass(frozen=True)
class Member:
  """A registered sampler as the weight trees see it; `relay`: where it serves the versions it holds ("": it
  does not)."""

  sampler_id: int
  name: str
  site: str
  relay: str


@dataclasses.dataclass
class _Entry:
  name: str
  last_seen: float
  site: str
  relay: str


def check_registration(settings: dict, message: Register) -> None:
  """Raises `BadMessage` when the sampler runs another configuration than the trainer's `settings`, or its relay
  is not an address."""
  differing = sorted(k for k in set(settings) | set(message.settings) if settings.get(k) != message.settings.get(k))
  if differing:
    key = differing[0]
    raise BadMessage(f"sampler {quote(message.name)} runs another configuration than the trainer: {len(differing)} "
                     f"settings differ, first {quote(key)} = {quote(message.settings.get(key))} (sampler) vs "
                     f"{quote(settings.get(key))} (trainer); give both the same --config and --set")
  if message.relay:
    try:
      parse_address(message.relay, "Register.relay")
    except ValueError as err:
      raise BadMessage(f"sampler {quote(message.name)}: {err}") from None


class Roster:
  """Samplers by id; `clock` says when they were heard from, `lease_timeout_s` how long one may be silent."""

  def __init__(self, scheduling: SchedulingConfig, timeline: Timeline, *, lease_timeout_s: float,
               clock: Callable[[], float]):
    self._scheduling, self._timeline = scheduling, timeline
    self.lease_timeout_s, self._clock = lease_timeout_s, clock
    self._samplers: dict[int, _Entry] = {}
    self._lost: dict[int, str] = {}  # ids declared lost -> name
    self._finished = False
    self._target = scheduling.instances

  def add(self, name: str, site: str = "", relay: str = "") -> int:
    """Registers a sampler under a fresh random id (never one in use or lost)."""
    sampler_id = secrets.randbits(62)
    while sampler_id in self._samplers or sampler_id in self._lost:
      sampler_id = secrets.randbits(62)
    self._samplers[sampler_id] = _Entry(name, self._clock(), site, relay)
    self._timeline.count(registered=1)
    return sampler_id

  def __contains__(self, sampler_id: int) -> bool:
    """Whether `sampler_id` is registered and not lost."""
    return sampler_id in self._samplers

  def __len__(self) -> int:
    return len(self._samplers)

  def is_lost(self, sampler_id: int) -> bool:
    return sampler_id in self._lost

  def name_of(self, sampler_id: int) -> str:
    """The name of a registered or a lost sampler."""
    entry = self._samplers.get(sampler_id)
    return entry.name if entry is not None else self._lost[sampler_id]

  def heard(self, sampler_id: int) -> None:
    """`sampler_id` was heard from now (nothing when it is not registered)."""
    if sampler_id in self._samplers:
      self._samplers[sampler_id].last_seen = self._clock()

  def silent(self) -> list[int]:
    """Samplers silent for more than `lease_timeout_s`."""
    now = self._clock()
    return [i for i, s in self._samplers.items() if now - s.last_seen > self.lease_timeout_s]

  def silent_s(self) -> float | None:
    """Seconds since any registered sampler was last heard from (None: none registered)."""
    if not self._samplers:
      return None
    return self._clock() - max(s.last_seen for s in self._samplers.values())

  def all_heard(self) -> None:
    """Every sampler heard from now: this process was paused, the others were not silent."""
    now = self._clock()
    for entry in self._samplers.values():
      entry.last_seen = now

  def remove(self, sampler_id: int, *, lost: bool) -> str:
    """Takes a sampler off the roster (a lost one is remembered by name); returns its name."""
    name = self._samplers.pop(sampler_id).name
    if lost:
      self._lost[sampler_id] = name
    self._timeline.count(samplers_lost=int(lost), samplers_left=int(not lost))
    return name

  def members(self) -> list[Member]:
    return [Member(i, s.name, s.site, s.relay) for i, s in self._samplers.items()]

  def relay_of(self, sampler_id: int) -> str:
    """Where a registered sampler serves weights ("": it does not, or it is gone)."""
    entry = self._samplers.get(sampler_id)
    return entry.relay if entry is not None else ""

  @property
  def finished(self) -> bool:
    return self._finished

  def finish(self) -> None:
    self._finished = True

  @property
  def target_instances(self) -> int:
    return self._target

  def set_target(self, instances: int) -> None:
    self._target = instances

  def retarget(self, summary: StepSummary, train_s: float) -> None:
    """The instance target by the elastic rule from a trained step's times, per sampler process (each runs its
    own instances)."""
    per_process = max(1, round(summary.sampler_instances / max(1, summary.sampler_processes)))
    self._target = self._scheduling.instance_target(per_process, summary.generation_s, train_s)
