"""Continuous batching over one or several engine instances; each finished sample leaves at once.

Instances (sampler replicas) can join, retire (draining their in-flight requests) or switch engines while
the sampler runs; a dispatch plan pins requests to instances and caps their busy slots.

`StreamingSampler.step()` admits queued requests into free slots (in the order of a pluggable, pure
admission policy), runs one `generate` call per busy instance (dispatched to all instances before
any result is read, so instances on disjoint devices overlap), reads the step outputs back once, and
returns the samples that finished, in finish order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from streamrl_jax.sampling.engine import DecodeEngine
from streamrl_jax.scheduling.policies import fifo_order
from streamrl_jax.types import FINISH_LENGTH, FINISH_STOP, FINISH_TURNS, Request, Rollout, Sample, SamplingParams

AdmissionPolicy = Callable[[Sequence[Request]], Sequence[int]]  # e.g. `scheduling.policies.fifo_order`


@dataclasses.dataclass
class _InFlight:
  request: Request
  admit_time: float
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)  # the policy version of each token
  first: object = None  # ((token, logprob, done) device arrays of its prefill call, its row), read at the next sync
  cache_end: int = 0  # upper bound of the slot's next cache write index
  resumed: bool = False  # admitted again after a preemption: its first token is one it had already
  mask: list = dataclasses.field(default_factory=list)  # per token: the model's (True) or an environment's
  env_state: object = None  # multi-turn: the environment's state of this episode
  turn_start: int = 0  # multi-turn: where the model's current turn began in `tokens`
  waiting: object = None  # multi-turn: the Future of the tool call the row is paused on
  env_reward: float = 0.0

  def rollout(self) -> Rollout:
    """Its tokens so far as a `Rollout`; an episode with an environment's tokens gives none (its environment's
    state stays here, so it starts again elsewhere)."""
    request, keep = self.request, all(self.mask) and self.waiting is None
    return Rollout(request.group_id, request.sample_index, tuple(self.tokens) if keep else (),
                   tuple(self.logprobs) if keep else (), tuple(self.versions) if keep else ())


@dataclasses.dataclass
class _Instance:
  index: int
  engine: DecodeEngine
  params: object
  state: object
  pending: list = dataclasses.field(default_factory=list)
  slots: dict = dataclasses.field(default_factory=dict)  # slot -> _InFlight
  slot_limit: int = 0  # slots that may be busy at once (a dispatch plan's batch size); 0: all
  retiring: bool = False  # takes no new requests; removed once its in-flight requests finish
  parked: dict = dataclasses.field(default_factory=dict)  # request id -> (_InFlight, place): off its slot on a tool
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


@jax.jit
def _fold_keys(root, groups, indices):
  fold = lambda g, i: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(root, g), i))  # noqa: E731
  return jax.vmap(fold)(groups, indices)


class StreamingSampler:
  """One request API over several `DecodeEngine` instances sharing one policy version."""

  def __init__(self, engines: Sequence[DecodeEngine], params, *, version: int = 0,
               admission: AdmissionPolicy = fifo_order, seed: int = 0, tools=None):
    """`tools` (an `envs.ToolRunner`): multi-turn episodes. A row whose turn ends with the environment's stop
    token pauses (its slot kept, the other rows decoding on), the environment's step runs on a host thread,
    and its observation is appended to the row by `extend` (loss mask 0) before the row goes on. While requests
    are queued, a paused row is parked off its slot (`park`: its cache kept aside on the device) so the slot
    decodes another request; it comes back into a free slot, before any queued request, once its tool returns."""
    if not engines:
      raise ValueError("StreamingSampler needs at least one engine")
    self.version, self.admission = version, admission
    self._root = jax.random.key(seed)
    self._params, self.tools = params, tools
    if tools is not None and not all(hasattr(e, "extend") for e in engines):
      raise ValueError("multi-turn tools need engines that extend rows in flight (`sampling.make_engine`'s)")
    self._tool_stops = set(tools.stop_ids) if tools is not None else set()
    self._instances = [_Instance(i, e, e.place_params(params), e.init_decode_state()) for i, e in enumerate(engines)]
    self._next_instance = len(self._instances)
    self._next_id = 0
    self._resume: dict[int, _InFlight] = {}  # request id -> a preempted request's progress, until admitted again
    self.counters = dict(submitted=0, finished=0, generated_tokens=0, decode_calls=0, preempted=0, recomputed=0,
                         resumed_partial=0, tool_calls=0, tool_tokens=0, extend_calls=0, parked=0)

  # ---- requests -----------------------------------------------------------------------------
  def submit(self, prompt, params: SamplingParams, *, group_id: int | None = None, instance: int | None = None,
             predicted_length: float | None = None, first_sample_index: int = 0,
             progress: Rollout | None = None) -> list[int]:
    """Queues `params.num_samples` requests for one prompt; returns their request ids.

    `instance` (an id from `instance_ids`) pins them to an engine instance (dispatch policies use
    this); otherwise the least loaded instance takes them. Samples are reproducible from (seed,
    group_id, sample_index), on any instance; sample indices start at `first_sample_index` (a group
    may be submitted one sample at a time). `progress` (one sample only) resumes a partial rollout after
    its tokens so far, which keep their log-probabilities, versions and loss mask.
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if self.tools is not None:
      stops = tuple(params.stop_token_ids) + tuple(i for i in self.tools.stop_ids if i not in params.stop_token_ids)
      params = dataclasses.replace(params, stop_token_ids=stops)
    if progress is not None and progress.tokens:
      if params.num_samples != 1:
        raise ValueError(f"a partial rollout resumes one sample; got num_samples={params.num_samples}")
      if len(progress.tokens) >= params.max_new_tokens or progress.tokens[-1] in params.stop_token_ids:
        raise ValueError(f"a partial rollout of {len(progress.tokens)} tokens (last {progress.tokens[-1]}) is "
                         f"finished already (max_new_tokens={params.max_new_tokens}, stop ids "
                         f"{list(params.stop_token_ids)}): nothing to resume")
    target = self._instance(instance) if instance is not None else min(self._accepting, key=lambda i: i.load)
    try:
      target.engine.check_request(len(prompt), params.max_new_tokens)
    except ValueError as err:
      raise ValueError(f"engine instance {target.index}: {err}") from None
    group_id = self._next_id if group_id is None else group_id
    ids, now = [], time.perf_counter()
    for k in range(params.num_samples):
      request = Request(self._next_id, prompt, params, group_id, first_sample_index + k, predicted_length, now)
      if progress is not None and progress.tokens:
        self._resume[request.request_id] = _InFlight(
            request, now, list(progress.tokens), list(progress.logprobs), list(progress.versions),
            mask=list(progress.loss_mask) or [True] * len(progress.tokens))
        self.counters["resumed_partial"] += 1
      target.pending.append(request)
      ids.append(self._next_id)
      self._next_id += 1
    self.counters["submitted"] += len(ids)
    return ids

  def update_params(self, params, version: int, *, recompute: bool = False) -> None:
    """Swaps the weights between decode steps; in-flight requests continue with the new version. Their KV
    cache, written by the old weights, is kept; with `recompute` each is prefilled again (prompt + tokens so
    far) by the new weights at its next admission. Tokens keep the version that sampled them."""
    for inst in self._instances:
      inst.params = inst.engine.place_params(params)
    self._params, self.version = params, version
    if recompute:
      for inst in self._instances:
        slots = [s for s, f in inst.slots.items() if f.tokens and f.waiting is None]
        for slot in slots:
          inst.state = inst.engine.release(inst.state, slot)
        self._requeue(inst, slots)
        self.counters["recomputed"] += len(slots)

  def in_flight_progress(self) -> list[tuple[Request, Rollout]]:
    """Every queued or running request with its tokens so far (a partial rollout to hand over when the
    sampler stops), in submission order."""
    requests = [r for inst in self._instances for r in inst.pending]
    flights = {f.request.request_id: f for inst in self._instances for f in inst.slots.values()}
    flights.update({f.request.request_id: f for inst in self._instances for f, _ in inst.parked.values()})
    flights.update(self._resume)
    requests += [f.request for f in flights.values() if f.request.request_id not in self._resume]
    out = []
    for request in sorted(requests, key=lambda r: r.request_id):
      flight = flights.get(request.request_id)
      out.append((request, flight.rollout() if flight is not None else
                  Rollout(request.group_id, request.sample_index, (), (), ())))
    return out

  # ---- instances ----------------------------------------------------------------------------
  @property
  def _accepting(self) -> list[_Instance]:
    return [i for i in self._instances if not i.retiring]

  @property
  def instance_ids(self) -> list[int]:
    """Ids of the instances that take new requests, in creation order."""
    return [i.index for i in self._accepting]

  def _instance(self, instance_id: int) -> _Instance:
    for inst in self._accepting:
      if inst.index == instance_id:
        return inst
    raise ValueError(f"no engine instance {instance_id} taking requests; have {self.instance_ids}")

  def set_slot_limits(self, limits: dict[int, int]) -> None:
    """Caps how many slots of each instance (by id) may be busy; a cap below the busy count lets the
    busy ones finish. 0 lifts the cap."""
    for instance_id, limit in limits.items():
      if limit < 0:
        raise ValueError(f"slot limit of instance {instance_id} must be >= 0, got {limit}")
      self._instance(instance_id).slot_limit = int(limit)

  def add_instance(self, engine: DecodeEngine) -> int:
    """Starts another engine instance (a sampler replica) with the current weights; returns its id."""
    inst = _Instance(self._next_instance, engine, engine.place_params(self._params), engine.init_decode_state())
    self._next_instance += 1
    self._instances.append(inst)
    return inst.index

  def replace_engine(self, instance_id: int, engine: DecodeEngine) -> None:
    """Runs an idle instance on another engine (e.g. the same mesh compiled for another slot count)."""
    inst = self._instance(instance_id)
    if inst.slots or inst.pending or inst.parked:
      raise ValueError(f"engine instance {instance_id} is busy ({len(inst.slots) + len(inst.parked)} in flight, "
                       f"{len(inst.pending)} queued); swap its engine between batches")
    inst.parking = None  # the parking room is the old engine's shape
    if engine is inst.engine:
      return
    if engine.mesh is not inst.engine.mesh:
      inst.params = engine.place_params(self._params)
    inst.engine, inst.state, inst.slot_limit = engine, engine.init_decode_state(), 0

  def retire_instance(self, instance_id: int) -> DecodeEngine:
    """Stops an instance taking requests: its queued requests move to the others (least loaded first),
    its in-flight requests finish where they are, then it is dropped. Returns its engine."""
    inst = self._instance(instance_id)
    others = [i for i in self._accepting if i is not inst]
    if not others:
      raise ValueError("cannot retire the last engine instance taking requests")
    inst.retiring = True
    for request in inst.pending:
      min(others, key=lambda i: i.load).pending.append(request)
    inst.pending = []
    self._drop_idle_retired()
    return inst.engine

  def _drop_idle_retired(self) -> None:
    self._instances = [i for i in self._instances if not (i.retiring and not i.slots and not i.parked)]

  @property
  def num_pending(self) -> int:
    return sum(len(i.pending) for i in self._instances)

  @property
  def num_in_flight(self) -> int:
    return sum(len(i.slots) + len(i.parked) for i in self._instances)

  def has_work(self) -> bool:
    return self.num_pending + self.num_in_flight > 0

  # ---- the loop -----------------------------------------------------------------------------
  def _request_keys(self, requests: Sequence[Request]) -> np.ndarray:
    """Key data [n, 2] of each request: fold_in(fold_in(root, group_id), sample_index)."""
    groups = np.asarray([r.group_id for r in requests], np.uint32)
    indices = np.asarray([r.sample_index for r in requests], np.uint32)
    return np.asarray(_fold_keys(self._root, groups, indices))

  def _admit(self, inst: _Instance, now: float) -> None:
    """Fills free slots from the queue in admission order, up to `prefill_batch` prompts per prefill call,
    while the engine has the memory (`admissible`); what does not fit goes back to the front of the queue."""
    slots = inst.free_slots
    chosen = []
    while len(chosen) < len(slots) and inst.pending:
      chosen.append(inst.pending.pop(next(iter(self.admission(inst.pending)))))
    start = 0
    while start < len(chosen):  # calls of power-of-two sizes: no padding rows (11 = 8 + 2 + 1)
      rows = min(inst.engine.config.prefill_batch, 1 << ((len(chosen) - start).bit_length() - 1))
      part = chosen[start:start + rows]
      prompts, resume = zip(*(self._prompt_of(r) for r in part))
      fits = inst.engine.admissible(inst.state, prompts, [0 if x is None else x[1] for x in resume], self.version)
      if fits < len(part):
        inst.pending[0:0] = chosen[start + fits:]
        chosen, part = chosen[:start + fits], part[:fits]
        if not part:
          break
      targets = slots[start:start + len(part)]
      start += len(part)
      extra = {"resume": resume[:len(part)]} if any(resume[:len(part)]) else {}
      prefix = inst.engine.prefill(inst.params, prompts[:len(part)], samplings=[r.params for r in part],
                                   rngs=self._request_keys(part), version=self.version, **extra)
      inst.state = inst.engine.insert(prefix, inst.state, targets)
      firsts = (prefix.first_token, prefix.first_logprob, prefix.done)
      for row, (request, slot) in enumerate(zip(part, targets)):
        flight = self._resume.pop(request.request_id, None)
        if flight is None:
          flight = _InFlight(request, now)
        if self.tools is not None and flight.env_state is None:  # fresh, or handed over before any tool call
          flight.env_state = self.tools.start(request.prompt, request.group_id * 1_000_003 + request.sample_index)
        flight.resumed = bool(resume[row])
        flight.cache_end, flight.first = prefix.valid.shape[1], (firsts, row)
        inst.slots[slot] = flight

  def _prompt_of(self, request: Request) -> tuple[np.ndarray, tuple[int, int] | None]:
    """(tokens to prefill, resume): a preempted request's prompt and tokens so far but its last, which is
    the next input (resume = (that token, tokens generated)); a fresh one's prompt and None."""
    flight = self._resume.get(request.request_id)
    if flight is None:
      return request.prompt, None
    so_far = np.asarray(flight.tokens[:-1], np.int32)
    return np.concatenate([request.prompt, so_far]), (flight.tokens[-1], len(flight.tokens))

  def _requeue(self, inst: _Instance, slots: list[int]) -> None:
    """Requests taken off their slots (preempted, or to recompute their cache) go back to the front of a
    queue with their progress."""
    for slot in reversed(slots):
      flight = inst.slots.pop(slot)
      if flight.first is not None:
        raise RuntimeError(f"engine instance {inst.index} gave up slot {slot} before its first token was read")
      self._resume[flight.request.request_id] = flight
      target = inst if not inst.retiring else min(self._accepting, key=lambda i: i.load)
      target.pending.insert(0, flight.request)

  def step(self) -> list[Sample]:
    """Admits, decodes `steps_per_sync` steps on every busy instance, returns finished samples."""
    now = time.perf_counter()
    outputs = []
    finished = []
    for inst in self._instances:
      if self.tools is not None:
        self._tool_results(inst, finished)
        self._park_waiting(inst)
      self._admit(inst, now)
      if inst.slots:  # rows whose first token is unread are never preempted: they have just been admitted
        progress = {s: len(f.tokens) if f.first is None else 1 << 30 for s, f in inst.slots.items()
                    if f.waiting is None}  # rows paused on a tool grow no further
        inst.state, preempted = inst.engine.make_room(inst.state, progress)
        self._requeue(inst, preempted)
        self.counters["preempted"] += len(preempted)
      waiting = [f.waiting for f in inst.slots.values() if f.waiting is not None and not f.waiting.done()]
      waiting += [f.waiting for f, _ in inst.parked.values() if not f.waiting.done()]
      if waiting and all(f.waiting is not None for f in inst.slots.values()):
        concurrent.futures.wait(waiting, timeout=0.05,
                                return_when=concurrent.futures.FIRST_COMPLETED)  # every row waits on a tool
      elif inst.slots:
        steps = inst.engine.config.steps_per_sync
        window = inst.engine.config.window_for(max(f.cache_end for f in inst.slots.values()) + steps)
        inst.state, out = inst.engine.generate(inst.params, inst.state, window)
        for flight in inst.slots.values():
          flight.cache_end += steps
        outputs.append((inst, out))
        self.counters["decode_calls"] += 1
    calls = {id(f.first[0]): f.first[0] for i in self._instances for f in i.slots.values() if f.first is not None}
    host_calls, host_outputs = jax.device_get((calls, [out for _, out in outputs]))
    now = time.perf_counter()
    for inst in self._instances:
      for slot, flight in list(inst.slots.items()):
        if flight.first is not None:
          token, logprob, done = (a[flight.first[1]] for a in host_calls[id(flight.first[0])])
          flight.first = None
          if flight.resumed:  # its first token is the last one it had: recorded already
            flight.resumed = False
            continue
          self._append(inst, slot, flight, token, logprob, bool(done), now, finished)
    for (inst, _), out in zip(outputs, host_outputs):
      for j in range(out.tokens.shape[0]):
        for slot in np.flatnonzero(out.active[j]):
          flight = inst.slots.get(int(slot))
          if flight is not None:
            self._append(inst, int(slot), flight, out.tokens[j, slot], out.logprobs[j, slot],
                         bool(out.done[j, slot]), now, finished)
    self._drop_idle_retired()
    return finished

  def _append(self, inst, slot, flight: _InFlight, token, logprob, done, now, finished) -> None:
    """Records one token; a finishing token frees the slot and appends the Sample to `finished`."""
    flight.tokens.append(int(token))
    flight.logprobs.append(float(logprob))
    flight.versions.append(self.version)
    flight.mask.append(True)
    if not done:
      return
    request = flight.request
    reason = FINISH_STOP if int(token) in request.params.stop_token_ids else FINISH_LENGTH
    if reason == FINISH_STOP and int(token) in self._tool_stops and len(flight.tokens) < request.params.max_new_tokens:
      flight.waiting = self.tools.submit(flight.env_state, flight.tokens[flight.turn_start:])  # the row pauses
      self.counters["tool_calls"] += 1
      return
    self._finish(inst, slot, flight, reason, now, finished)

  def _tool_results(self, inst: _Instance, finished: list) -> None:
    """Rows whose tool call has returned: the observation is appended (`extend`, one call for them all) and
    the row goes on, or the episode ends (the environment says so, or no room for the observation is left).
    A parked row comes back into a free slot first; with none free it waits for the next step."""
    ready = [(slot, f, None) for slot, f in inst.slots.items() if f.waiting is not None and f.waiting.done()]
    ready += [(None, f, place) for f, place in inst.parked.values() if f.waiting.done()]
    free = inst.free_slots
    slots, chunks, places, unparked = [], [], [], []
    for slot, flight, place in ready:
      result = flight.waiting.result()
      room = flight.request.params.max_new_tokens - len(flight.tokens)
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
      flight.waiting = None
      flight.env_state, flight.env_reward = result.state, flight.env_reward + result.reward
      if ends:
        self._finish(inst, slot, flight, FINISH_TURNS if result.done else FINISH_LENGTH, time.perf_counter(),
                     finished)
        continue
      slots.append(slot)
      chunks.append([flight.tokens[-1], *result.tokens])
      flight.tokens.extend(result.tokens)
      flight.logprobs.extend([0.0] * len(result.tokens))
      flight.versions.extend([self.version] * len(result.tokens))
      flight.mask.extend([False] * len(result.tokens))
      flight.turn_start = len(flight.tokens)
      flight.cache_end += len(result.tokens) + 1
      self.counters["tool_tokens"] += len(result.tokens)
    if places:
      inst.state, inst.parking = inst.engine.unpark(inst.state, inst.parking, places, unparked)
    self._extend_rows(inst, slots, chunks)

  def _extend_rows(self, inst: _Instance, slots: list[int], chunks: list[list[int]]) -> None:
    """Appends each row's chunk (its stop token and the tool's tokens) and lets it decode on. A row the engine
    has no memory for (a paged pool that is full) gives up its slot and resumes later, its tokens kept."""
    if not slots:
      return
    inst.state, refused = inst.engine.extend_room(inst.state, {s: len(c) for s, c in zip(slots, chunks)})
    for slot in refused:
      inst.state = inst.engine.release(inst.state, slot)
    self._requeue(inst, refused)
    self.counters["preempted"] += len(refused)
    kept = [(s, c) for s, c in zip(slots, chunks) if s not in refused]
    if kept:
      slots, chunks = map(list, zip(*kept))
      inst.state, firsts = inst.engine.extend(inst.params, inst.state, slots, chunks)
      self.counters["extend_calls"] += 1
      for slot, first in zip(slots, firsts):
        inst.slots[slot].first = first

  def _park_waiting(self, inst: _Instance) -> None:
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
      flight = inst.slots.pop(slot)
      inst.parked[flight.request.request_id] = (flight, place)
      inst.state = inst.engine.release(inst.state, slot)
    self.counters["parked"] += len(moving)

  def _finish(self, inst, slot, flight: _InFlight, reason: str, now, finished) -> None:
    """Frees the slot (None: a parked row holds none) and appends the finished Sample to `finished`."""
    if slot is not None:
      del inst.slots[slot]
      inst.state = inst.engine.release(inst.state, slot)
    request = flight.request
    finished.append(Sample(
        request_id=request.request_id, group_id=request.group_id, sample_index=request.sample_index,
        prompt_tokens=request.prompt, completion_tokens=np.asarray(flight.tokens, np.int32),
        logprobs=np.asarray(flight.logprobs, np.float32), token_versions=np.asarray(flight.versions, np.int32),
        finish_reason=reason, first_version=min(flight.versions), last_version=max(flight.versions), instance=inst.index,
        submit_time=request.submit_time, admit_time=flight.admit_time, finish_time=now,
        loss_mask=None if all(flight.mask) else np.asarray(flight.mask, bool), env_reward=flight.env_reward))
    self.counters["finished"] += 1
    self.counters["generated_tokens"] += len(flight.tokens)

  def stream(self) -> Iterator[Sample]:
    """Yields every sample as it finishes until no request is queued or in flight."""
    while self.has_work():
      yield from self.step()
