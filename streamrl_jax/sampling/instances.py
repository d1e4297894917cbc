"""The engine instances (sampler replicas) of one sampler: each one's engine, weights, decode state, queue, busy
slots and rows parked on a tool. The roster adds, retires and re-engines them, caps their busy slots and puts
requests on the least loaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from streamrl_jax.sampling.engine import DecodeEngine
from streamrl_jax.sampling.in_flight import InFlight
from streamrl_jax.types import Request


@dataclasses.dataclass
class Instance:
  """One engine instance and the requests it holds."""

  index: int
  engine: DecodeEngine
  params: object
  state: object
  pending: list = dataclasses.field(default_factory=list)
  slots: dict = dataclasses.field(default_factory=dict)  # slot -> InFlight
  slot_limit: int = 0  # slots that may be busy at once (a dispatch plan's batch size); 0: all
  retiring: bool = False  # takes no new requests; removed once its in-flight requests finish
  parked: dict = dataclasses.field(default_factory=dict)  # request id -> (InFlight, place): off its slot on a tool
  parking: object = None  # the engine's room for parked rows (made at the first park)

  @property
  def capacity(self) -> int:
    slots = self.engine.config.num_slots
    return min(slots, self.slot_limit) if self.slot_limit else slots

  @property
  def free_slots(self) -> list[int]:
    room = max(0, self.capacity - len(self.slots))
    return [s for s in range(self.engine.config.num_slots) if s not in self.slots][:room]

  @property
  def load(self) -> float:
    return (len(self.pending) + len(self.slots)) / self.capacity

  def free(self, slot: int) -> InFlight:
    """Takes a row off its slot and gives the slot's memory back; returns the row."""
    flight = self.slots.pop(slot)
    self.state = self.engine.release(self.state, slot)
    return flight

  def cancel(self, ids: set) -> int:
    """Drops the requests of `ids` wherever they are here: queued, on a slot (its memory given back) or parked on a
    tool (a tool call they wait on is not wanted any more); returns how many were dropped."""
    kept = [r for r in self.pending if r.request_id not in ids]
    dropped = len(self.pending) - len(kept)
    self.pending = kept
    for slot in [s for s, f in self.slots.items() if f.request.request_id in ids]:
      _abandon(self.free(slot))
      dropped += 1
    for request_id in [r for r in self.parked if r in ids]:
      flight, place = self.parked.pop(request_id)
      self.state, self.parking = self.engine.drop_parked(self.state, self.parking, place)
      _abandon(flight)
      dropped += 1
    return dropped

  def release_decoding(self) -> list[int]:
    """Gives back the memory of every decoding row with tokens (not one waiting on a tool): their cache is to be
    computed again; returns their slots, the rows still on them."""
    slots = [s for s, f in self.slots.items() if f.completion_tokens and f.waiting is None]
    for slot in slots:
      self.state = self.engine.release(self.state, slot)
    return slots

  def make_room(self) -> list[int]:
    """Memory for the rows' next tokens; returns the slots of the rows the engine had none for (preempted, their
    memory given back). Rows whose first token is unread are never preempted (they have just been admitted); rows
    paused on a tool grow no further."""
    if not self.slots:
      return []
    progress = {s: len(f.completion_tokens) if f.first is None else 1 << 30 for s, f in self.slots.items()
                if f.waiting is None}
    self.state, preempted = self.engine.make_room(self.state, progress)
    return preempted


class InstanceSet:
  """One sampler's instances, in creation order, and the weights they run."""

  def __init__(self, engines: Sequence[DecodeEngine], params):
    self.instances = [Instance(i, e, e.place_params(params), e.init_decode_state()) for i, e in enumerate(engines)]
    self._params, self._next_index = params, len(self.instances)

  @property
  def accepting(self) -> list[Instance]:
    """The instances that take new requests."""
    return [i for i in self.instances if not i.retiring]

  def get(self, instance_id: int) -> Instance:
    """The instance of that id; it must be taking requests."""
    for inst in self.accepting:
      if inst.index == instance_id:
        return inst
    raise ValueError(f"no engine instance {instance_id} taking requests; have {[i.index for i in self.accepting]}")

  def least_loaded(self) -> Instance:
    return min(self.accepting, key=lambda i: i.load)

  def place_params(self, params) -> None:
    """Every instance runs `params` from its next call on."""
    for inst in self.instances:
      inst.params = inst.engine.place_params(params)
    self._params = params

  def set_slot_limits(self, limits: dict[int, int]) -> None:
    for instance_id, limit in limits.items():
      if limit < 0:
        raise ValueError(f"slot limit of instance {instance_id} must be >= 0, got {limit}")
      self.get(instance_id).slot_limit = int(limit)

  def add(self, engine: DecodeEngine) -> int:
    inst = Instance(self._next_index, engine, engine.place_params(self._params), engine.init_decode_state())
    self._next_index += 1
    self.instances.append(inst)
    return inst.index

  def replace_engine(self, instance_id: int, engine: DecodeEngine) -> None:
    inst = self.get(instance_id)
    if inst.slots or inst.pending or inst.parked:
      raise ValueError(f"engine instance {instance_id} is busy ({len(inst.slots) + len(inst.parked)} in flight, "
                       f"{len(inst.pending)} queued); swap its engine between batches")
    inst.parking = None  # the parking room is the old engine's shape
    if engine is inst.engine:
      return
    if engine.mesh is not inst.engine.mesh:
      inst.params = engine.place_params(self._params)
    inst.engine, inst.state, inst.slot_limit = engine, engine.init_decode_state(), 0

  def retire(self, instance_id: int) -> DecodeEngine:
    inst = self.get(instance_id)
    if len(self.accepting) < 2:
      raise ValueError("cannot retire the last engine instance taking requests")
    inst.retiring = True
    for request in inst.pending:
      self.least_loaded().pending.append(request)
    inst.pending = []
    self.drop_idle_retired()
    return inst.engine

  def drop_idle_retired(self) -> None:
    self.instances = [i for i in self.instances if not (i.retiring and not i.slots and not i.parked)]

  def requeue(self, inst: Instance, slots: list[int]) -> list[InFlight]:
    """Takes the rows of `slots` (their memory given back already) off them and puts their requests back at the
    front of a queue: the instance's own, or the least loaded one's if it retires. Returns the rows, last first."""
    for slot in reversed(slots):
      if inst.slots[slot].first is not None:
        raise RuntimeError(f"engine instance {inst.index} gave up slot {slot} before its first token was read")
    flights = [inst.slots.pop(slot) for slot in reversed(slots)]
    for flight in flights:
      (inst if not inst.retiring else self.least_loaded()).pending.insert(0, flight.request)
    return flights

  def queued(self) -> list[Request]:
    return [r for inst in self.instances for r in inst.pending]

  def rows(self) -> dict[int, InFlight]:
    """Request id -> every row on a slot or parked."""
    flights = {f.request.request_id: f for inst in self.instances for f in inst.slots.values()}
    flights.update({f.request.request_id: f for inst in self.instances for f, _ in inst.parked.values()})
    return flights

  @property
  def num_in_flight(self) -> int:
    return sum(len(i.slots) + len(i.parked) for i in self.instances)


def _abandon(flight: InFlight) -> None:
  """A dropped row's tool call, if it waits on one, is not wanted any more."""
  if flight.waiting is not None:
    flight.waiting.cancel()
