"""A mixture of experts' routes as a sampler records them: each call's experts placed at the positions it computed,
and the routes of prompts kept by (weights version, prompt), for requests whose prompt a paged engine's prefix cache
held (no call of theirs computed it)."""

from __future__ import annotations

import collections

from streamrl_jax.sampling.in_flight import InFlight

PROMPT_ROUTES = 256  # prompts whose routes are kept


class RouteBook:
  """The routes of prompts recorded at each weights version, the most recent `capacity`."""

  def __init__(self, capacity: int = PROMPT_ROUTES):
    self.capacity = capacity
    self._prompts: collections.OrderedDict = collections.OrderedDict()  # (version, prompt bytes) -> its routes

  def first_call(self, flight: InFlight, values: list, version: int) -> tuple:
    """A prefill or extend call's outputs of `flight`'s row, (token, logprob, done[, routes]): the routes (when the
    model routes: [call width, sparse layers, k]) placed where the call started (`flight.routes_at`), a prompt the call
    did not compute taking the routes recorded of it at this version. Returns (token, logprob, done)."""
    if len(values) > 3:
      self._place(flight, values[3], version)
    return tuple(values[:3])

  def _place(self, flight: InFlight, routes, version: int) -> None:
    start, count = flight.routes_at
    flight.place_routes(start, routes[:count])
    key = (version, flight.request.prompt_tokens.tobytes())
    known = flight.prompt_routes()
    if known is not None:
      self._prompts[key] = known
      self._prompts.move_to_end(key)
      while len(self._prompts) > self.capacity:
        self._prompts.popitem(last=False)
    elif key in self._prompts:
      flight.routes[:len(self._prompts[key])] = self._prompts[key]

  @staticmethod
  def decode_step(flight: InFlight, routes, step: int, slot: int) -> None:
    """Step `step`'s experts (`routes` [steps, slots, sparse layers, k]; None: a dense model) of the token it fed
    `slot`'s row: the row's last."""
    if routes is not None:
      last = len(flight.request.prompt_tokens) + len(flight.completion_tokens) - 1
      flight.place_routes(last, routes[step, slot][None])
