"""The OpenAI-compatible HTTP application (Starlette): `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(whole or streamed as server-sent events) and `/health`, in front of a `RequestBridge` to a sampler.

Every request is checked before anything reaches the engine (key, body size, JSON, fields, model, template, prompt
length, token bounds, the concurrency bound); every failure is an OpenAI error body with its status. A request
whose client goes away, or that runs past its time, has its choices cancelled, so the engine's slots and pages are
freed. A request tagged with an open episode (`x-streamrl-episode`) is one turn of that episode's transcript."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from streamrl_jax.counters import Counters
from streamrl_jax.models.chat import ChatTemplateError
from streamrl_jax.serving.bridge import Cancel, Finished, Generate, Progress, Refused, RequestBridge
from streamrl_jax.serving.config import ServeConfig
from streamrl_jax.serving.episodes import EPISODE_HEADER, Episodes, Turn
from streamrl_jax.serving.protocol import ApiError, Call, parse_body, parse_call
from streamrl_jax.serving.responses import Reply, sse
from streamrl_jax.serving.text_stream import ChoiceText
from streamrl_jax.types import SamplingParams

VERSION_HEADER = "x-weight-version"


@dataclasses.dataclass(frozen=True)
class ServedModel:
  """The model a server answers for: its name, tokenizer and the engine's prompt and generation bounds."""

  name: str
  tokenizer: object
  max_prompt_length: int
  max_new_tokens: int


@dataclasses.dataclass(slots=True, eq=False)
class HttpCounters(Counters):
  """HTTP requests, errors, busy refusals and clients gone."""

  http_requests: int = 0
  http_errors: int = 0
  http_busy: int = 0
  http_disconnects: int = 0


class Service:
  """The server's state, touched only by its event loop: the model, bounds, the bridge, episodes and counters."""

  def __init__(self, model: ServedModel, config: ServeConfig, bridge: RequestBridge):
    self.model, self.config, self.bridge = model, config, bridge
    tokenizer = model.tokenizer
    self.episodes = Episodes(tokenizer.encode, tokenizer.token_text, tokenizer.decode,
                             tokenizer.render_chat if tokenizer.chat_template else None)
    self.active = 0
    self.started = int(time.time())
    self._next_key = 0
    self.counters = HttpCounters()

  def next_key(self) -> int:
    self._next_key += 1
    return self._next_key

  def authorize(self, request: Request) -> None:
    if not self.config.api_key:
      return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
      raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

  async def read_body(self, request: Request) -> bytes:
    limit = self.config.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
      raise ApiError(413, f"the request body has {length} bytes; this server takes at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
      body += chunk
      if len(body) > limit:
        raise ApiError(413, f"the request body is over this server's {limit} bytes")
    return bytes(body)

  def render(self, call: Call) -> str:
    """The request's text before encoding: the chat template over its messages, or its prompt."""
    if not call.chat:
      return call.prompt
    tokenizer = self.model.tokenizer
    if not tokenizer.chat_template:
      raise ApiError(400, f"model {self.model.name!r} has no chat template; use /v1/completions")
    try:
      return tokenizer.render_chat([dict(m) for m in call.messages])
    except (ChatTemplateError, ValueError) as err:
      raise ApiError(400, f"the chat template refused the messages: {err}", param="messages") from None

  def encode(self, call: Call, rendered: str) -> list[int]:
    tokenizer = self.model.tokenizer
    try:
      return tokenizer.encode(rendered) if call.chat else tokenizer.encode_prompt(rendered)
    except ValueError as err:
      raise ApiError(400, f"the prompt cannot be encoded: {err}", param="messages" if call.chat else "prompt") from None

  def max_tokens(self, call: Call, prompt: np.ndarray, turn: Turn | None) -> int:
    """Tokens the request generates at most: asked, within the server's bound and an episode's budget."""
    model = self.model
    if len(prompt) > model.max_prompt_length:
      raise ApiError(400, f"the prompt has {len(prompt)} tokens; this engine takes at most "
                          f"{model.max_prompt_length}", param="messages" if call.chat else "prompt",
                     code="context_length_exceeded")
    bound = min(self.config.max_tokens or model.max_new_tokens, model.max_new_tokens)
    if call.max_tokens is not None and call.max_tokens > bound:
      raise ApiError(400, f"max_tokens={call.max_tokens} is over this server's bound of {bound}", param="max_tokens")
    room = bound if turn is None else min(bound, turn.room)
    return min(call.max_tokens or room, room)


class _Run:
  """One request's generation: its choices as their events arrive from the sampler's thread."""

  def __init__(self, service: Service, call: Call, prompt: np.ndarray, params: SamplingParams, turn: Turn | None):
    self.service, self.call, self.turn = service, call, turn
    self.loop = asyncio.get_running_loop()
    self.queue: asyncio.Queue = asyncio.Queue()
    tokenizer = service.model.tokenizer
    self.choices = [ChoiceText(tokenizer.decode, call.stop, tokenizer.stop_ids) for _ in range(call.n)]
    self.key = service.next_key()
    self.deadline = self.loop.time() + service.config.request_timeout_s
    self._request = Generate(self.key, prompt, params, None if call.seed is None else call.seed % (1 << 32),
                             self._sink)
    self.started = False

  def start(self) -> None:
    """Hands the request to the sampler (a stream does so once its response has begun: a client gone before
    that costs nothing)."""
    self.started = True
    self.service.active += 1
    self.service.bridge.post(self._request)

  def _sink(self, event) -> None:
    self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

  @property
  def done(self) -> bool:
    return all(c.done for c in self.choices)

  async def events(self):
    """Yields the index of each choice an event changed, until every choice is done."""
    while not self.done:
      try:
        event = await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - self.loop.time()))
      except asyncio.TimeoutError:
        raise ApiError(504, f"the request ran past request_timeout_s={self.service.config.request_timeout_s}",
                       type="timeout_error") from None
      if isinstance(event, Refused):
        raise ApiError(event.status, event.message, type="invalid_request_error" if event.status < 500 else
                       "server_error")
      choice = self.choices[event.choice]
      if isinstance(event, Progress):
        if choice.add(event.tokens, event.logprobs, event.versions):  # a stop string: the rest is not wanted
          self.service.bridge.post(Cancel(self.key, event.choice))
      elif isinstance(event, Finished):
        sample = event.sample
        reason = "length" if sample.finish_reason == "length" else "stop"
        choice.finish(reason, sample.completion_tokens.tolist(), sample.logprobs.tolist(),
                      sample.versions.tolist())
      yield event.choice

  def close(self) -> None:
    """Cancels what is not finished and records an episode's turn (or lets the episode go on without it)."""
    service = self.service
    if self.started:
      service.active -= 1
      if not self.done:
        service.bridge.post(Cancel(self.key))
    if self.turn is not None:
      if self.done:
        service.episodes.record(self.turn, self.choices[0])
      else:
        service.episodes.abort(self.turn)


def make_app(service: Service) -> Starlette:
  """The Starlette application of `service`."""

  async def models(request: Request):
    service.authorize(request)
    return JSONResponse({"object": "list", "data": [
        {"id": service.model.name, "object": "model", "created": service.started, "owned_by": "streamrl_jax",
         "weight_version": service.bridge.version}]})

  async def health(request: Request):
    return JSONResponse({"status": "ok", "weight_version": service.bridge.version, "requests": service.active})

  async def completions(request: Request):
    return await _complete(service, request, chat=False)

  async def chat_completions(request: Request):
    return await _complete(service, request, chat=True)

  async def api_error(request: Request, err: ApiError):
    service.counters.http_errors += 1
    return JSONResponse(err.body(), status_code=err.status)

  async def http_error(request: Request, err: HTTPException):
    service.counters.http_errors += 1
    kind = "not_found" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                 type=kind).body(), status_code=err.status_code)

  routes = [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"])]
  return Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error})


async def _complete(service: Service, request: Request, *, chat: bool):
  service.counters.http_requests += 1
  service.authorize(request)
  call = parse_call(parse_body(await service.read_body(request)), chat=chat, max_n=service.config.max_n)
  if call.model != service.model.name:
    raise ApiError(404, f"model {call.model!r} does not exist here; this server serves {service.model.name!r}",
                   param="model", code="model_not_found")
  if service.active >= service.config.max_requests:
    service.counters.http_busy += 1
    raise ApiError(429, f"the server is at its bound of {service.config.max_requests} requests; retry later",
                   type="rate_limit_error", code="rate_limit_exceeded")
  if service.bridge.version < 0:
    raise ApiError(503, "no weights have landed on this sampler yet; retry later", type="server_error")
  rendered = service.render(call)
  tag = request.headers.get(EPISODE_HEADER, "")
  turn = service.episodes.begin(tag, rendered, lambda text: service.encode(call, text), call.n,
                                call.messages if call.chat else None) if tag else None
  try:
    prompt = turn.prompt_tokens if turn is not None else np.asarray(service.encode(call, rendered), np.int32)
    forced = service.config.temperature
    params = SamplingParams(temperature=forced if forced >= 0 else call.temperature, top_k=call.top_k, top_p=call.top_p,
                            min_p=call.min_p,
                            max_new_tokens=service.max_tokens(call, prompt, turn),
                            stop_token_ids=service.model.tokenizer.stop_ids, num_samples=call.n)
  except BaseException:
    if turn is not None:
      service.episodes.abort(turn)
    raise
  run = _Run(service, call, prompt, params, turn)
  reply = Reply.of(call, run.key, service.model.name, prompt, service.model.tokenizer.token_text)
  if call.stream:
    return StreamingResponse(_stream(service, run, reply), media_type="text/event-stream",
                             headers={VERSION_HEADER: str(service.bridge.version), "cache-control": "no-cache"})
  try:
    run.start()
    async for _ in run.events():
      pass
  finally:
    run.close()
  body = reply.whole(run.choices)
  return JSONResponse(body, headers={VERSION_HEADER: str(body["weight_version"])})


async def _stream(service: Service, run: _Run, reply: Reply):
  """The server-sent events of a streamed request; a client that goes away cancels what is left."""
  marks, ended = [0] * len(run.choices), [False] * len(run.choices)
  try:
    run.start()
    if run.call.chat:
      for index in range(len(run.choices)):
        yield sse(reply.chunk(index, "", [], [], [], None, first=True))
    async for index in run.events():
      choice = run.choices[index]
      text, start = choice.sendable(), marks[index]
      marks[index] = len(choice.tokens)
      reason = choice.finish_reason if choice.done and not ended[index] else None
      ended[index] = choice.done
      tokens_wanted = run.call.logprobs or run.call.return_token_ids
      if text or reason or (tokens_wanted and marks[index] > start):
        yield sse(reply.chunk(index, text, choice.tokens[start:], choice.logprobs[start:], choice.versions[start:],
                              reason))
    if run.call.include_usage:
      yield sse(reply.usage_chunk(run.choices))
    yield sse("[DONE]")
  except ApiError as err:
    service.counters.http_errors += 1
    yield sse(err.body())
  except (asyncio.CancelledError, GeneratorExit):
    service.counters.http_disconnects += 1
    raise
  finally:
    run.close()


__all__ = ["ServedModel", "Service", "make_app", "VERSION_HEADER"]
