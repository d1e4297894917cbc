"""A teacher's or judge's stage on a pool that is another program (`streamrl scorer`, over Arrow Flight): the scorer
holds the frozen model on its own devices and answers token rows with their scores (`ScorerFlightServer`); the
trainer's flow calls it as the stage's model (`RemoteScorer`), a shard's rows a request, and checks what comes back
like any stage's output. Requests and replies are typed control messages (`messages.ScoreRequest`, `Scores`), checked
field by field; a scorer serving another stage, kind or vocabulary is refused when the trainer connects."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import pyarrow as pa
from pyarrow import flight

from streamrl_jax.counters import Counters
from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import BadMessage, ScoreRequest, ScorerInfo, ScorerQuery, Scores
from streamrl_jax.streaming.flight_client import FlightConnection
from streamrl_jax.streaming.flight_server import server_tls_options
from streamrl_jax.workflow.graph import GraphError

REQUEST_TOKENS = 1 << 16  # tokens a request holds at most: a shard of more goes in several (the codec's bound)
SCORE_TIMEOUT_S = 600.0  # one request's deadline: a large judge on a CPU scores a shard in seconds, not minutes


@dataclasses.dataclass(slots=True, eq=False)
class ScorerCounters(Counters):
  requests: int = 0
  rows: int = 0
  refused: int = 0


class ScorerFlightServer(flight.FlightServerBase):
  """Serves `score(tokens, valid)` (a teacher's or judge's, `kind`) for stage `stage`; listening from construction,
  `shutdown()` to stop. One request scores at a time (the model's memory stays one call's)."""

  def __init__(self, host: str, port: int, *, stage: str, kind: str, vocab_size: int, score: Callable, tls=None):
    super().__init__(f"{'grpc+tls' if tls else 'grpc+tcp'}://{host}:{port}", **server_tls_options(tls))
    self.address = f"{host}:{self.port}"
    self.info = ScorerInfo(stage, kind, vocab_size)
    self.score = score
    self.counters = ScorerCounters()
    self._lock = threading.Lock()

  def do_action(self, context, action):
    if action.type != "control":
      raise flight.FlightServerError(f"unknown action {action.type!r}; this server takes 'control'")
    try:
      message = decode_message(action.body.to_pybytes())
      if isinstance(message, ScorerQuery):
        reply = self._info(message)
      elif isinstance(message, ScoreRequest):
        reply = self._score(message)
      else:
        raise BadMessage(f"a scorer takes ScorerQuery and ScoreRequest messages, not {type(message).__name__}")
    except BadMessage as err:
      with self._lock:
        self.counters.refused += 1
      raise flight.FlightServerError(str(err)[:500]) from None
    return [flight.Result(pa.py_buffer(encode_message(reply)))]

  def _info(self, query: ScorerQuery) -> ScorerInfo:
    if query.stage != self.info.stage:
      raise BadMessage(f"this scorer serves stage {self.info.stage!r}, not {query.stage!r}")
    return self.info

  def _score(self, request: ScoreRequest) -> Scores:
    tokens = np.asarray(request.tokens, np.int32).reshape(request.rows, request.length)
    if tokens.size and tokens.max() >= self.info.vocab_size:
      raise BadMessage(f"token id {int(tokens.max())} is not below the scorer's vocabulary of {self.info.vocab_size}")
    valid = np.asarray(request.valid, bool).reshape(tokens.shape)
    with self._lock:
      out = np.asarray(self.score(tokens, valid), np.float32)
      self.counters.requests += 1
      self.counters.rows += request.rows
    if not np.all(np.isfinite(out)):
      raise BadMessage("the scorer's model gave values that are not finite numbers")
    return Scores(tuple(out.ravel().tolist()))


class RemoteScorer:
  """The scorer program at `address` as stage `stage`'s frozen model of `kind`: called with token rows like a local
  one ([rows] a judge's, [rows, length] a teacher's). Refused at once (GraphError) when it serves another stage, kind
  or vocabulary than the policy's `vocab_size`; waits up to `retry_s` for a scorer still starting."""

  def __init__(self, address: str, stage: str, kind: str, vocab_size: int, tls=None, retry_s: float = 120.0):
    self.kind = kind
    self.connection = FlightConnection(address, tls=tls, timeout_s=SCORE_TIMEOUT_S, retry_s=retry_s,
                                       peer=f"the scorer of stage {stage!r}")
    try:
      info = self.connection.action(ScorerQuery(stage), ScorerInfo)
    except BadMessage as err:
      raise GraphError(f"stage {stage!r} at {address}: {err}") from None
    if (info.kind, info.vocab_size) != (kind, vocab_size):
      raise GraphError(f"stage {stage!r} at {address}: the scorer serves a {info.kind} reading {info.vocab_size} "
                       f"token ids; the stage needs a {kind} of the policy's {vocab_size}")

  def __call__(self, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    rows, length = np.shape(tokens)
    step = max(1, REQUEST_TOKENS // max(length, 1))
    parts = []
    for start in range(0, rows, step):
      part, mask = np.asarray(tokens[start:start + step]), np.asarray(valid[start:start + step], bool)
      request = ScoreRequest(len(part), length, tuple(part.ravel().tolist()), tuple(mask.ravel().tolist()))
      parts.append(np.asarray(self.connection.action(request, Scores).values, np.float32))
    flat = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return flat.reshape(rows, length) if self.kind == "teacher" and flat.size == rows * length else flat

  def close(self) -> None:
    self.connection.close()
