"""Multi-turn rows: a row whose turn ends with a tool's stop token pauses on the tool's call (run on a host thread),
keeping its slot or, while requests are queued, parked off it; once the tool returns, its tokens are appended to
the row (`extend`, loss mask 0) and the row decodes on, or the episode ends."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable

from streamrl_jax.sampling.in_flight import InFlight
from streamrl_jax.sampling.instances import Instance
from streamrl_jax.types import FINISH_LENGTH, FINISH_TURNS, SamplingParams

Finish = Callable[[int | None, InFlight, str], None]  # (slot or None: parked, row, finish reason)


class ToolTurns:
  """The tool calls of one sampler's rows (`tools`: an `envs.ToolRunner`), counted in the sampler's `counters`."""

  def __init__(self, tools, counters):
    self.tools, self.counters = tools, counters
    self._stops = set(tools.stop_ids)

  def with_stops(self, params: SamplingParams) -> SamplingParams:
    """`params` stopping at the tools' stop tokens too."""
    stops = tuple(params.stop_token_ids) + tuple(i for i in self.tools.stop_ids if i not in params.stop_token_ids)
    return dataclasses.replace(params, stop_token_ids=stops)

  def start(self, flight: InFlight) -> None:
    """Starts the episode of an admitted row that has none (fresh, or handed over before any tool call)."""
    if flight.env_state is None:
      request = flight.request
      flight.env_state = self.tools.start(request.prompt_tokens, request.group_id * 1_000_003 + request.sample_index)

  def call(self, flight: InFlight, token: int) -> bool:
    """Pauses a row that stopped on a tool's stop token, with room left, on the tool's call; False if not."""
    if int(token) not in self._stops or len(flight.completion_tokens) >= flight.request.params.max_new_tokens:
      return False
    flight.waiting = self.tools.submit(flight.env_state, flight.completion_tokens[flight.turn_start:])
    self.counters.tool_calls += 1
    return True

  def wait_if_stalled(self, inst: Instance) -> bool:
    """While every row of `inst` waits on a tool (none decodes), waits a little for one to return; True if so."""
    waiting = [f.waiting for f in inst.slots.values() if f.waiting is not None and not f.waiting.done()]
    waiting += [f.waiting for f, _ in inst.parked.values() if not f.waiting.done()]
    if not waiting or any(f.waiting is None for f in inst.slots.values()):
      return False
    concurrent.futures.wait(waiting, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
    return True

  def take_results(self, inst: Instance, version: int, finish: Finish) -> list[int]:
    """Rows whose tool call has returned: the tool's tokens are appended (`extend`, one call for them all) and
    the row goes on, or the episode ends (the environment says so, or no room for the tokens is left). A parked
    row comes back into a free slot first; with none free it waits for the next step. Returns the slots of rows
    the engine had no memory for: given back, to resume later with their tokens kept."""
    free = inst.free_slots
    slots, chunks, places, unparked = [], [], [], []
    for slot, flight, place in self._returned(inst):
      result = flight.waiting.result()
      room = flight.request.params.max_new_tokens - len(flight.completion_tokens)
      ends = result.done or len(result.tokens) >= room
      if slot is None and not ends:
        if not free:
          continue  # no slot yet: it keeps its place among the parked
        slot = free.pop(0)
        places.append(place)
        unparked.append(slot)
        inst.slots[slot] = flight
      if place is not None:
        del inst.parked[flight.request.request_id]
        if ends:  # its memory (a paged row's pages) goes back where it was parked
          inst.state, inst.parking = inst.engine.drop_parked(inst.state, inst.parking, place)
      flight.waiting = None
      flight.env_state, flight.env_reward = result.state, flight.env_reward + result.reward
      if ends:
        finish(slot, flight, FINISH_TURNS if result.done else FINISH_LENGTH)
        continue
      slots.append(slot)
      chunks.append([flight.completion_tokens[-1], *result.tokens])  # the stop token, then the tool's tokens
      flight.observe(result.tokens, version)
      flight.cache_end += len(result.tokens) + 1
      self.counters.tool_tokens += len(result.tokens)
    if places:
      inst.state, inst.parking = inst.engine.unpark(inst.state, inst.parking, places, unparked)
    return self._extend(inst, slots, chunks)

  @staticmethod
  def _returned(inst: Instance) -> list[tuple[int | None, InFlight, int | None]]:
    """(slot, row, parking place) of each row whose tool call has returned: on a slot, then parked."""
    ready = [(slot, f, None) for slot, f in inst.slots.items() if f.waiting is not None and f.waiting.done()]
    return ready + [(None, f, place) for f, place in inst.parked.values() if f.waiting.done()]

  def _extend(self, inst: Instance, slots: list[int], chunks: list[list[int]]) -> list[int]:
    """Appends each row's chunk and lets it decode on; returns the slots the engine had no memory for (a paged
    pool that is full), their memory given back."""
    if not slots:
      return []
    inst.state, refused = inst.engine.extend_room(inst.state, {s: len(c) for s, c in zip(slots, chunks)})
    for slot in refused:
      inst.state = inst.engine.release(inst.state, slot)
    kept = [(s, c) for s, c in zip(slots, chunks) if s not in refused]
    if kept:
      slots, chunks = map(list, zip(*kept))
      inst.state, firsts = inst.engine.extend(inst.params, inst.state, slots, chunks)
      self.counters.extend_calls += 1
      for slot, first, chunk in zip(slots, firsts, chunks):
        flight = inst.slots[slot]
        flight.first = first
        # a mixture's routes of the appended tokens: the chunk ends at the row's last token
        end = len(flight.request.prompt_tokens) + len(flight.completion_tokens)
        flight.routes_at = (end - len(chunk), len(chunk))
    return refused

  def park_waiting(self, inst: Instance) -> None:
    """Rows still waiting on a tool a step after their call (a quick tool has returned by then) leave their
    slots to queued requests: parked, their cache kept aside on the device (at most a slot's worth of rows)."""
    if not hasattr(inst.engine, "park"):
      return
    taken = {place for _, place in inst.parked.values()}
    room = [p for p in range(inst.engine.config.num_slots) if p not in taken]
    waiting = sorted(slot for slot, f in inst.slots.items() if f.waiting is not None)
    moving = waiting[:min(len(inst.pending), len(room))]
    if not moving:
      return
    if inst.parking is None:
      inst.parking = inst.engine.init_parking()
    inst.state, inst.parking = inst.engine.park(inst.state, inst.parking, moving, room[:len(moving)])
    for slot, place in zip(moving, room):
      flight = inst.free(slot)
      inst.parked[flight.request.request_id] = (flight, place)
    self.counters.parked += len(moving)
