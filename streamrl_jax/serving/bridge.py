"""Served requests into a `StreamingSampler` and their tokens back out, through typed messages.

The server's threads `post` a `Generate` or a `Cancel`; the thread that owns the sampler (the standalone
server's loop, or a sampler worker between its decode steps) calls `pump` to take them in and `deliver` after each
`step` to send every live request's new tokens (`Progress`) and finished choices (`Finished`) to the request's
`sink`, handing back the samples that are not the server's (a lease's). Nothing here is touched by two threads
but the inbox, a thread-safe queue."""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Callable

import numpy as np

from streamrl_jax.counters import Counters
from streamrl_jax.types import Sample, SamplingParams


@dataclasses.dataclass(frozen=True)
class Generate:
  """A served request: `params.num_samples` choices of one prompt. `group_id` (from the request's seed) makes the
  choices reproducible; None: the sampler numbers them. `sink(event)` is called from the sampler's thread."""

  key: int
  prompt_tokens: np.ndarray
  params: SamplingParams
  group_id: int | None
  sink: Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class Cancel:
  """Drops a served request's choices (`choice`: only that one) that have not finished."""

  key: int
  choice: int | None = None


@dataclasses.dataclass(frozen=True)
class Progress:
  """Tokens a choice sampled since its last `Progress`, each with its log-probability and weight version."""

  choice: int
  tokens: tuple[int, ...]
  logprobs: tuple[float, ...]
  versions: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Finished:
  choice: int
  sample: Sample


@dataclasses.dataclass(frozen=True)
class Refused:
  status: int
  message: str


@dataclasses.dataclass
class _Live:
  request: Generate
  ids: list[int]
  sent: dict[int, int]  # request id -> tokens already sent
  open: set[int]  # request ids not finished


@dataclasses.dataclass(slots=True, eq=False)
class ServedCounters(Counters):
  """Requests served, their choices and tokens, and those cancelled or refused."""

  served_requests: int = 0
  served_choices: int = 0
  served_tokens: int = 0
  served_cancelled: int = 0
  served_refused: int = 0


class RequestBridge:
  """The door between a server's threads and the thread that owns a sampler. `before_leases`: served requests go
  to the front of their queue; otherwise they wait while any other request is queued."""

  def __init__(self, *, before_leases: bool = True):
    self.before_leases = before_leases
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._wake = threading.Event()
    self._waiting: collections.deque[Generate] = collections.deque()
    self._live: dict[int, _Live] = {}
    self._owner: dict[int, tuple[int, int]] = {}  # request id -> (key, choice)
    self.version = -1  # the newest weights' version the sampler runs (-1: none landed yet)
    self.closed = ""  # why the bridge takes no more requests ("": it does)
    self.counters = ServedCounters()

  # ---- any thread ---------------------------------------------------------------------------------
  def post(self, message: Generate | Cancel) -> None:
    if self.closed and isinstance(message, Generate):
      _send(message, Refused(503, self.closed))
      return
    self._inbox.put(message)
    self._wake.set()

  def post_wake(self) -> None:
    """Wakes the owner's idle wait with no message (to look at its stop flag)."""
    self._wake.set()

  def wait(self, timeout: float) -> None:
    """Blocks until a message is posted (or `timeout`): the owner's idle wait."""
    self._wake.wait(timeout)
    self._wake.clear()

  # ---- the sampler's thread -----------------------------------------------------------------------
  @property
  def busy(self) -> bool:
    """Whether any served request is waiting or generating (or a message is in)."""
    return bool(self._live or self._waiting) or not self._inbox.empty()

  @property
  def request_ids(self) -> frozenset:
    """The sampler's request ids of the served requests not finished."""
    return frozenset(self._owner)

  @property
  def live_requests(self) -> int:
    return len(self._live) + len(self._waiting)

  def pump(self, sampler) -> None:
    """Takes the posted messages in: cancels drop their requests, new requests are submitted (by priority)."""
    self.version = sampler.version
    for message in self._drain():
      if isinstance(message, Cancel):
        self._cancel(sampler, message.key, message.choice)
      else:
        self._waiting.append(message)
    if not self.before_leases and sampler.num_pending:
      return
    for request in reversed(self._waiting) if self.before_leases else list(self._waiting):
      self._submit(sampler, request)  # before leases each goes to the front: the last first keeps their order
    self._waiting.clear()

  def deliver(self, sampler, finished: list[Sample]) -> list[Sample]:
    """Sends each live request its new tokens and finished choices; returns the samples that are not served ones."""
    if not self._owner:
      return finished
    others, done = [], []
    for sample in finished:
      (done if sample.request_id in self._owner else others).append(sample)
    sent = {i: live.sent[i] for live in self._live.values() for i in live.open}
    for request_id, (tokens, logprobs, versions) in sampler.progress(sent).items():
      key, choice = self._owner[request_id]
      live = self._live[key]
      live.sent[request_id] += len(tokens)
      _send(live.request, Progress(choice, tuple(tokens), tuple(logprobs), tuple(versions)))
    for sample in done:
      key, choice = self._owner.pop(sample.request_id)
      live = self._live[key]
      live.open.discard(sample.request_id)
      self.counters.served_choices += 1
      self.counters.served_tokens += sample.num_tokens
      _send(live.request, Finished(choice, sample))
      if not live.open:
        del self._live[key]
    return others

  def refuse_all(self, sampler, message: str) -> None:
    """Refuses every request not finished (503, `message`), dropping them from the sampler (None: it is gone)."""
    self._waiting.extend(m for m in self._drain() if isinstance(m, Generate))
    for request in list(self._waiting) + [live.request for live in self._live.values()]:
      _send(request, Refused(503, message))
    if sampler is not None:
      sampler.cancel([i for live in self._live.values() for i in live.open])
    self._waiting.clear()
    self._live.clear()
    self._owner.clear()

  def close(self, sampler, message: str) -> None:
    """`refuse_all`, and every later request too."""
    self.closed = message
    self.refuse_all(sampler, message)

  def _drain(self):
    """The posted messages, in order, until the inbox is empty."""
    while True:
      try:
        yield self._inbox.get_nowait()
      except queue.Empty:
        return

  def _submit(self, sampler, request: Generate) -> None:
    try:
      ids = sampler.submit(request.prompt_tokens, request.params, group_id=request.group_id, first=self.before_leases)
    except ValueError as err:
      self.counters.served_refused += 1
      _send(request, Refused(400, str(err)))
      return
    self.counters.served_requests += 1
    self._live[request.key] = _Live(request, ids, {i: 0 for i in ids}, set(ids))
    for choice, request_id in enumerate(ids):
      self._owner[request_id] = (request.key, choice)

  def _cancel(self, sampler, key: int, choice: int | None) -> None:
    if choice is None:
      self._waiting = collections.deque(r for r in self._waiting if r.key != key)
    live = self._live.get(key)
    if live is None:
      return
    dropped = [i for i in live.open if choice is None or self._owner[i][1] == choice]
    sampler.cancel(dropped)
    for request_id in dropped:
      self._owner.pop(request_id, None)
      live.open.discard(request_id)
    self.counters.served_cancelled += len(dropped)
    if not live.open:
      del self._live[key]


def _send(request: Generate, event) -> None:
  try:
    request.sink(event)
  except RuntimeError:  # the server's event loop has closed: nobody is listening any more
    pass
