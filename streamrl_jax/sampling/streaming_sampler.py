"""Continuous batching over one or several engine instances; each finished sample leaves at once.

`StreamingSampler` is the request API over its parts: the instances (`instances.InstanceSet`), admission into free
slots (`admission.Admitter`), multi-turn rows (`tool_turns.ToolTurns`) and each request's progress
(`in_flight.InFlight`). `step()` admits queued requests, makes room for the rows to grow (the engine preempts what
does not fit), runs one `generate` call per busy instance (dispatched to all instances before any result is read,
so instances on disjoint devices overlap), reads the outputs back once, and returns the samples that finished, in
finish order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from streamrl_jax.counters import Counters
from streamrl_jax.phase_clock import PhaseClock
from streamrl_jax.sampling.admission import AdmissionPolicy, Admitter, StepsPolicy
from streamrl_jax.sampling.engine import DecodeEngine
from streamrl_jax.sampling.in_flight import InFlight, check_resumable
from streamrl_jax.sampling.instances import Instance, InstanceSet
from streamrl_jax.sampling.routes import RouteBook
from streamrl_jax.sampling.tool_turns import ToolTurns
from streamrl_jax.scheduling.policies import adaptive_steps, fifo_order
from streamrl_jax.types import FINISH_LENGTH, FINISH_STOP, Request, Rollout, Sample, SamplingParams


@dataclasses.dataclass(slots=True, eq=False)
class SamplerCounters(Counters):
  """A sampler's requests, tokens and decode calls, rows preempted, resumed and parked, tool turns."""

  submitted: int = 0
  finished: int = 0
  generated_tokens: int = 0
  decode_calls: int = 0
  preempted: int = 0
  recomputed: int = 0
  resumed_partial: int = 0
  tool_calls: int = 0
  tool_tokens: int = 0
  extend_calls: int = 0
  parked: int = 0
  cancelled: int = 0


class StreamingSampler:
  """One request API over several `DecodeEngine` instances sharing one policy version."""

  def __init__(self, engines: Sequence[DecodeEngine], params, *, version: int = 0,
               admission: AdmissionPolicy = fifo_order, steps: StepsPolicy = adaptive_steps, seed: int = 0,
               tools=None, clock: PhaseClock | None = None):
    """`tools` (an `envs.ToolRunner`): multi-turn episodes. A row whose turn ends with the environment's stop
    token pauses (its slot kept, the other rows decoding on), the environment's step runs on a host thread,
    and its observation is appended to the row by `extend` (loss mask 0) before the row goes on. While requests
    are queued, a paused row is parked off its slot (`park`: its cache kept aside on the device) so the slot
    decodes another request; it comes back into a free slot, before any queued request, once its tool returns.
    `steps` picks each decode call's length from the rows' remaining tokens (`scheduling.policies`).
    `clock` (the calling thread's; default one of its own): prefill and decode calls, their dispatch and the wait
    for their results, go to its `prefill` and `decode`."""
    if not engines:
      raise ValueError("StreamingSampler needs at least one engine")
    if tools is not None and not all(hasattr(e, "extend") for e in engines):
      raise ValueError("multi-turn tools need engines that extend rows in flight (`sampling.make_engine`'s)")
    self.version, self.admission, self.steps, self.tools = version, admission, steps, tools
    self._set = InstanceSet(engines, params)
    self._next_id = 0
    self.counters = SamplerCounters()
    self._turns = ToolTurns(tools, self.counters) if tools is not None else None
    self._phase = (clock or PhaseClock(("prefill", "decode"))).phase
    self._admitter = Admitter(seed, self._turns, self._phase)
    self._routes = RouteBook()  # a mixture's routes: where each call's go, and prompts' by version

  # ---- requests -----------------------------------------------------------------------------
  def submit(self, prompt, params: SamplingParams, *, group_id: int | None = None, instance: int | None = None,
             predicted_length: float | None = None, first_sample_index: int = 0,
             progress: Rollout | None = None, first: bool = False) -> list[int]:
    """Queues `params.num_samples` requests for one prompt; returns their request ids.

    `instance` (an id from `instance_ids`) pins them to an engine instance (dispatch policies use
    this); otherwise the least loaded instance takes them. Samples are reproducible from (seed,
    group_id, sample_index), on any instance; sample indices start at `first_sample_index` (a group
    may be submitted one sample at a time). `progress` (one sample only) resumes a partial rollout after
    its completion tokens so far, which keep their log-probabilities, versions and loss mask. `first` puts them at
    the front of their queue (ahead of requests already waiting: served requests of a higher priority).
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    params = self._turns.with_stops(params) if self._turns is not None else params
    resuming = progress is not None and bool(progress.completion_tokens)
    if resuming:
      check_resumable(progress, params)
    target = self._set.get(instance) if instance is not None else self._set.least_loaded()
    try:
      target.engine.check_request(len(prompt), params.max_new_tokens)
    except ValueError as err:
      raise ValueError(f"engine instance {target.index}: {err}") from None
    group_id = self._next_id if group_id is None else group_id
    requests, now = [], time.perf_counter()
    for k in range(params.num_samples):
      request = Request(self._next_id, prompt, params, group_id, first_sample_index + k, predicted_length, now)
      if resuming:
        self._admitter.hold(InFlight.resuming(request, now, progress))
        self.counters.resumed_partial += 1
      requests.append(request)
      self._next_id += 1
    if first:
      target.pending[0:0] = requests
    else:
      target.pending.extend(requests)
    ids = [r.request_id for r in requests]
    self.counters.submitted += len(ids)
    return ids

  def update_params(self, params, version: int, *, recompute: bool = False) -> None:
    """Swaps the weights between decode steps; in-flight requests continue with the new version. Their KV
    cache, written by the old weights, is kept; with `recompute` each is prefilled again (prompt + tokens so
    far) by the new weights at its next admission. Tokens keep the version that sampled them."""
    self._set.place_params(params)
    self.version = version
    if recompute:
      for inst in self._set.instances:
        self._requeue(inst, inst.release_decoding(), "recomputed")

  def in_flight_progress(self) -> list[tuple[Request, Rollout]]:
    """Every queued or running request with its completion so far (a partial rollout to hand over when the
    sampler stops), in submission order."""
    held = self._admitter.held()
    flights = {**self._set.rows(), **held}
    requests = self._set.queued() + [f.request for f in flights.values() if f.request.request_id not in held]
    return [(r, flights[r.request_id].rollout() if r.request_id in flights else
             Rollout(r.group_id, r.sample_index, (), (), ())) for r in sorted(requests, key=lambda r: r.request_id)]

  def cancel(self, request_ids) -> int:
    """Drops requests wherever they are: queued, on a slot (its memory given back), parked on a tool or held to
    resume. Unknown ids (finished already) are ignored; returns how many were dropped."""
    ids = set(request_ids)
    dropped = sum(inst.cancel(ids) for inst in self._set.instances)
    self._admitter.drop(ids)
    self.counters.cancelled += dropped
    return dropped

  def progress(self, seen: dict[int, int]) -> dict[int, tuple[list[int], list[float], list[int]]]:
    """Request id -> (completion tokens, log-probabilities, versions) sampled after the first `seen[id]`, copied, of
    each request in `seen` with new ones (on a slot, parked or held to resume; a queued fresh one has none yet)."""
    flights = {**self._admitter.held(), **self._set.rows()}
    return {i: (f.completion_tokens[n:], f.logprobs[n:], f.versions[n:]) for i, n in seen.items()
            if (f := flights.get(i)) is not None and len(f.completion_tokens) > n}

  # ---- instances ----------------------------------------------------------------------------
  @property
  def _instances(self) -> list[Instance]:
    """The roster's instances, retiring ones too (tests read their decode states)."""
    return self._set.instances

  @property
  def instance_ids(self) -> list[int]:
    """Ids of the instances that take new requests, in creation order."""
    return [i.index for i in self._set.accepting]

  def set_slot_limits(self, limits: dict[int, int]) -> None:
    """Caps how many slots of each instance (by id) may be busy; a cap below the busy count lets the
    busy ones finish. 0 lifts the cap."""
    self._set.set_slot_limits(limits)

  def add_instance(self, engine: DecodeEngine) -> int:
    """Starts another engine instance (a sampler replica) with the current weights; returns its id."""
    return self._set.add(engine)

  def replace_engine(self, instance_id: int, engine: DecodeEngine) -> None:
    """Runs an idle instance on another engine (e.g. the same mesh compiled for another slot count)."""
    self._set.replace_engine(instance_id, engine)

  def retire_instance(self, instance_id: int) -> DecodeEngine:
    """Stops an instance taking requests: its queued requests move to the others (least loaded first),
    its in-flight requests finish where they are, then it is dropped. Returns its engine."""
    return self._set.retire(instance_id)

  @property
  def num_pending(self) -> int:
    return len(self._set.queued())

  @property
  def num_in_flight(self) -> int:
    return self._set.num_in_flight

  def has_work(self) -> bool:
    return self.num_pending + self.num_in_flight > 0

  # ---- the loop -----------------------------------------------------------------------------
  def step(self) -> list[Sample]:
    """Admits, decodes on every busy instance (the steps the policy picks), returns finished samples."""
    now, finished, outputs = time.perf_counter(), [], []
    for inst in self._set.instances:
      if self._turns is not None:
        self._tool_turns(inst, finished)
      self._admitter.admit(inst, self.admission, self.version, now)
      self._requeue(inst, inst.make_room(), "preempted")  # the engine preempts rows it has no memory for
      out = self._decode(inst)
      if out is not None:
        outputs.append((inst, out))
    self._read_back(outputs, finished)
    self._set.drop_idle_retired()
    return finished

  def _tool_turns(self, inst: Instance, finished: list) -> None:
    """Rows whose tool returned go on (or end); rows still waiting leave their slots to queued requests."""
    def finish(slot, flight, reason):
      self._finish(inst, slot, flight, reason, time.perf_counter(), finished)
    self._requeue(inst, self._turns.take_results(inst, self.version, finish), "preempted")
    self._turns.park_waiting(inst)

  def _requeue(self, inst: Instance, slots: list[int], counter: str) -> None:
    """Requests taken off their slots (preempted, or to recompute their cache) go back to the front of a
    queue with their progress; `counters[counter]` counts them."""
    for flight in self._set.requeue(inst, slots):
      self._admitter.hold(flight)
    self.counters.add(counter, len(slots))

  def _decode(self, inst: Instance):
    """Dispatches one `generate` call of the steps the policy picks (not read yet); None if no row decodes (while
    every row waits on a tool, after a short wait for one)."""
    if (self._turns is not None and self._turns.wait_if_stalled(inst)) or not inst.slots:
      return None
    decoding = [f for f in inst.slots.values() if f.waiting is None]
    steps = self.steps([f.remaining for f in decoding], fresh=sum(f.first is not None for f in decoding),
                       options=inst.engine.config.step_options)
    window = inst.engine.config.window_for(max(f.cache_end for f in inst.slots.values()) + steps)
    with self._phase("decode"):  # the dispatch (a launch that waits for its devices, a compile) is the decode's
      inst.state, out = inst.engine.generate(inst.params, inst.state, window, steps)
    for flight in inst.slots.values():
      flight.cache_end += steps
    self.counters.decode_calls += 1
    return out

  def _read_back(self, outputs: list, finished: list) -> None:
    """Reads the new rows' first tokens, then every step output back (the device runs the calls in the order they
    were launched: the first wait is the prefill's, the second the decode's); records their tokens."""
    calls = {id(f.first[0]): f.first[0] for i in self._set.instances for f in i.slots.values()
             if f.first is not None}
    with self._phase("prefill"):
      host_calls = jax.device_get(calls)
    with self._phase("decode"):
      host_outputs = jax.device_get([out for _, out in outputs])
    now = time.perf_counter()
    for inst in self._set.instances:
      self._record_first_tokens(inst, host_calls, now, finished)
    for (inst, _), out in zip(outputs, host_outputs):
      self._record_steps(inst, out, now, finished)

  def _record_first_tokens(self, inst: Instance, host_calls: dict, now: float, finished: list) -> None:
    """The first token of each row a prefill (or `extend`) call started, from the calls' outputs read back."""
    for slot, flight in list(inst.slots.items()):
      if flight.first is not None:
        token, logprob, done = self._routes.first_call(
            flight, [a[flight.first[1]] for a in host_calls[id(flight.first[0])]], self.version)
        flight.first = None
        if flight.resumed:  # its first token is the last one it had: recorded already
          flight.resumed = False
          continue
        self._append(inst, slot, flight, token, logprob, bool(done), now, finished)

  def _record_steps(self, inst: Instance, out, now: float, finished: list) -> None:
    """The tokens of one `generate` call read back: step by step, each active slot's."""
    for j in range(out.tokens.shape[0]):
      for slot in np.flatnonzero(out.active[j]):
        flight = inst.slots.get(int(slot))
        if flight is not None:
          self._routes.decode_step(flight, out.routes, j, slot)
          self._append(inst, int(slot), flight, out.tokens[j, slot], out.logprobs[j, slot], bool(out.done[j, slot]),
                       now, finished)

  def _append(self, inst: Instance, slot: int, flight: InFlight, token, logprob, done: bool, now: float,
              finished: list) -> None:
    """Records one token; a finishing token frees the slot and appends the Sample to `finished` (a tool's stop
    token pauses the row on the tool's call instead)."""
    flight.add(token, logprob, self.version)
    if not done:
      return
    reason = FINISH_STOP if int(token) in flight.request.params.stop_token_ids else FINISH_LENGTH
    if reason == FINISH_STOP and self._turns is not None and self._turns.call(flight, token):
      return
    self._finish(inst, slot, flight, reason, now, finished)

  def _finish(self, inst: Instance, slot: int | None, flight: InFlight, reason: str, now: float,
              finished: list) -> None:
    """Frees the slot (None: a parked row holds none) and appends the finished Sample to `finished`."""
    if slot is not None:
      inst.free(slot)
    finished.append(flight.sample(reason, inst.index, now))
    self.counters.finished += 1
    self.counters.generated_tokens += len(flight.completion_tokens)

  def stream(self) -> Iterator[Sample]:
    """Yields every sample as it finishes until no request is queued or in flight."""
    while self.has_work():
      yield from self.step()
