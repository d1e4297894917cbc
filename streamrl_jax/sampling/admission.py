"""Admission: queued requests into an instance's free slots, in the order of a pluggable, pure policy, by prefill
calls of power-of-two sizes while the engine has the memory. A request that goes on where it stopped (preempted,
taken off to recompute its cache, or handed over part-done) is held here with its progress until admitted again.
A request samples with the key fold_in(fold_in(root, group_id), sample_index), on any instance."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from streamrl_jax.sampling.in_flight import InFlight
from streamrl_jax.sampling.instances import Instance
from streamrl_jax.sampling.tool_turns import ToolTurns
from streamrl_jax.types import Request

AdmissionPolicy = Callable[[Sequence[Request]], Sequence[int]]  # e.g. `scheduling.policies.fifo_order`
StepsPolicy = Callable[..., int]  # (remaining, *, fresh, options) -> steps: `policies.adaptive_steps`


@jax.jit
def _fold_keys(root, groups, indices):
  fold = lambda g, i: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(root, g), i))  # noqa: E731
  return jax.vmap(fold)(groups, indices)


class Admitter:
  """Admits one sampler's requests (keys from `seed`); `turns` starts the episodes of multi-turn rows."""

  def __init__(self, seed: int, turns: ToolTurns | None, phase: Callable):
    """`phase(name)`: the calling thread's `PhaseClock.phase`; prefill calls go to its `prefill`."""
    self._root, self._turns, self._phase = jax.random.key(seed), turns, phase
    self._held: dict[int, InFlight] = {}  # request id -> progress of a queued request that resumes

  def hold(self, flight: InFlight) -> None:
    """Keeps a queued request's progress until it is admitted again."""
    self._held[flight.request.request_id] = flight

  def drop(self, request_ids) -> None:
    """Forgets the progress of dropped requests."""
    for request_id in request_ids:
      self._held.pop(request_id, None)

  def held(self) -> dict[int, InFlight]:
    """Request id -> progress, of every queued request that resumes."""
    return dict(self._held)

  def admit(self, inst: Instance, policy: AdmissionPolicy, version: int, now: float) -> None:
    """Fills free slots from the queue in `policy`'s order, up to `prefill_batch` prompts per prefill call,
    while the engine has the memory (`admissible`); what does not fit goes back to the front of the queue."""
    slots = inst.free_slots
    chosen = []
    while len(chosen) < len(slots) and inst.pending:
      chosen.append(inst.pending.pop(next(iter(policy(inst.pending)))))
    start = 0
    while start < len(chosen):  # calls of power-of-two sizes: no padding rows (11 = 8 + 2 + 1)
      rows = min(inst.engine.config.prefill_batch, 1 << ((len(chosen) - start).bit_length() - 1))
      part = chosen[start:start + rows]
      prompts, resume = zip(*(self._prompt_of(r) for r in part))
      fits = inst.engine.admissible(inst.state, prompts, [0 if x is None else x[1] for x in resume], version)
      if fits < len(part):
        inst.pending[0:0] = chosen[start + fits:]
        chosen, part = chosen[:start + fits], part[:fits]
        if not part:
          break
      self._prefill(inst, part, prompts[:len(part)], resume[:len(part)], slots[start:start + len(part)], version,
                    now)
      start += len(part)

  def _prefill(self, inst: Instance, part: list[Request], prompts: tuple, resume: tuple, targets: list[int],
               version: int, now: float) -> None:
    """One prefill call of `part` into the slots `targets`; their first tokens are read at the next sync."""
    extra = {"resume": resume} if any(resume) else {}
    with self._phase("prefill"):  # the dispatch (a launch that waits for its devices, a compile) is the prefill's
      prefix = inst.engine.prefill(inst.params, prompts, samplings=[r.params for r in part],
                                   rngs=self._keys(part), version=version, **extra)
      inst.state = inst.engine.insert(prefix, inst.state, targets)
    firsts = (prefix.first_token, prefix.first_logprob, prefix.done) + (() if prefix.routes is None else
                                                                         (prefix.routes,))
    for row, (request, slot) in enumerate(zip(part, targets)):
      flight = self._held.pop(request.request_id, None)
      if flight is None:
        flight = InFlight(request, now)
      if self._turns is not None:
        self._turns.start(flight)
      flight.resumed = bool(resume[row])
      flight.cache_end, flight.first = prefix.valid.shape[1], (firsts, row)
      flight.routes_at = (0, len(prompts[row]))  # a mixture's routes of what the call prefilled
      inst.slots[slot] = flight

  def _prompt_of(self, request: Request) -> tuple[np.ndarray, tuple[int, int] | None]:
    """(tokens to prefill, resume): a held request's `InFlight.prefill_input`; a fresh one's prompt and None."""
    flight = self._held.get(request.request_id)
    return (request.prompt_tokens, None) if flight is None else flight.prefill_input()

  def _keys(self, requests: Sequence[Request]) -> np.ndarray:
    """Key data [n, 2] of each request: fold_in(fold_in(root, group_id), sample_index)."""
    groups = np.asarray([r.group_id for r in requests], np.uint32)
    indices = np.asarray([r.sample_index for r in requests], np.uint32)
    return np.asarray(_fold_keys(self._root, groups, indices))
