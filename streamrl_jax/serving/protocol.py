"""The OpenAI request bodies the server takes, checked field by field into one typed `Call`, and the error body it
answers with (`ApiError`: the status, OpenAI's `{"error": {...}}` shape, the first problem named by its field).

Unknown fields are refused rather than ignored, so a caller never believes a setting took effect when it did not;
fields OpenAI defines that this server does not implement are refused unless they hold their neutral value."""

from __future__ import annotations

import dataclasses
import json
import math

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 200
ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
  """An OpenAI-style error: HTTP `status`, a message naming the first problem, its `type`, `param` and `code`."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Call:
  """One completion request, checked. `messages` for a chat call, `prompt` for a text completion."""

  chat: bool
  model: str
  prompt: str = ""
  messages: tuple = ()  # of {"role": str, "content": str}
  max_tokens: int | None = None  # None: as many as the bounds allow (chat), 16 (text)
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0  # vLLM's extension: tokens at least min_p times as likely as the most likely
  stop: tuple[str, ...] = ()
  n: int = 1
  logprobs: bool = False
  seed: int | None = None
  stream: bool = False
  include_usage: bool = False
  return_token_ids: bool = False  # extension: each choice's sampled ids, their versions, and the prompt's ids
  user: str = ""


def parse_body(raw: bytes) -> dict:
  """The JSON object of a request body."""
  try:
    body = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as err:
    raise ApiError(400, f"the request body is not valid JSON: {err}") from None
  if not isinstance(body, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
  return body


def _int(name, value, lo, hi=None, none=False):
  if value is None and none:
    return None
  if isinstance(value, bool) or not isinstance(value, int):
    raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)[:40]}", param=name)
  if value < lo or (hi is not None and value > hi):
    raise ApiError(400, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", param=name)
  return value


def _number(name, value, lo, hi, *, open_lo=False):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ApiError(400, f"'{name}' must be a finite number, got {json.dumps(value)[:40]}", param=name)
  if value < lo or value > hi or (open_lo and value == lo):
    raise ApiError(400, f"'{name}' must be in {'(' if open_lo else '['}{lo}, {hi}], got {value}", param=name)
  return float(value)


def _bool(name, value):
  if not isinstance(value, bool):
    raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(value)[:40]}", param=name)
  return value


def _str(name, value):
  if not isinstance(value, str):
    raise ApiError(400, f"'{name}' must be a string, got {json.dumps(value)[:40]}", param=name)
  return value


def _stop(value) -> tuple[str, ...]:
  if value is None:
    return ()
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
  if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
    raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings of {MAX_STOP_CHARS} characters", param="stop")
  return tuple(stops)


def _content(where: str, value) -> str:
  """A message's content: a string, or a list of text parts (joined)."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    texts = []
    for i, part in enumerate(value):
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ApiError(400, f"'{where}.content[{i}]' must be a text part {{\"type\": \"text\", \"text\": ...}}",
                       param=f"{where}.content")
      texts.append(part["text"])
    return "".join(texts)
  raise ApiError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")


def _messages(value) -> tuple:
  if not isinstance(value, list) or not value:
    raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
  out = []
  for i, message in enumerate(value):
    where = f"messages[{i}]"
    if not isinstance(message, dict):
      raise ApiError(400, f"'{where}' must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
      raise ApiError(400, f"'{where}.role' must be one of {list(ROLES)}, got {json.dumps(role)[:40]}",
                     param=f"{where}.role")
    if message.get("tool_calls"):
      raise ApiError(400, f"'{where}.tool_calls': structured tool calls are not supported; an agent writes its "
                          "calls in the text (examples/agent)", param=f"{where}.tool_calls")
    out.append({"role": role, "content": _content(where, message.get("content", ""))})
  return tuple(out)


def _text_prompt(value) -> str:
  if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
    return value[0]
  if isinstance(value, str):
    return value
  raise ApiError(400, "'prompt' must be a string (one prompt per request)", param="prompt")


# Fields OpenAI defines that this server does not implement, with the value that means "off".
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "echo": False, "suffix": None,
            "best_of": None, "top_logprobs": 0, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
            "response_format": None, "service_tier": None, "store": False, "metadata": None}
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "n", "logprobs", "seed", "stream",
           "stream_options", "user", "return_token_ids")
CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens")) | _NEUTRAL.keys()
TEXT_FIELDS = frozenset(_COMMON + ("prompt",)) | _NEUTRAL.keys()


def parse_call(body: dict, *, chat: bool, max_n: int) -> Call:
  """`body` (a chat or text completion request) as a `Call`; the first problem raises `ApiError` 400."""
  known = CHAT_FIELDS if chat else TEXT_FIELDS
  unknown = sorted(set(body) - known)
  if unknown:
    raise ApiError(400, f"unknown field '{unknown[0]}'", param=unknown[0])
  for name, neutral in _NEUTRAL.items():
    value = body.get(name, neutral)
    if value not in (neutral, None) and value != {} and value != []:
      raise ApiError(400, f"'{name}' is not supported by this server (leave it out)", param=name)
  if "model" not in body:
    raise ApiError(400, "'model' is required", param="model")
  fields = dict(chat=chat, model=_str("model", body["model"]))
  if chat:
    fields["messages"] = _messages(body.get("messages"))
  else:
    if "prompt" not in body:
      raise ApiError(400, "'prompt' is required", param="prompt")
    fields["prompt"] = _text_prompt(body["prompt"])
  tokens_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  fields["max_tokens"] = _int(tokens_key, body.get(tokens_key), 1, none=True)
  if not chat and fields["max_tokens"] is None:
    fields["max_tokens"] = 16  # OpenAI's default for text completions
  if body.get("temperature") is not None:
    fields["temperature"] = _number("temperature", body["temperature"], 0.0, 2.0)
  if body.get("top_p") is not None:
    fields["top_p"] = _number("top_p", body["top_p"], 0.0, 1.0, open_lo=True)
  if body.get("top_k") is not None:
    fields["top_k"] = max(_int("top_k", body["top_k"], -1), 0)  # -1 and 0: off
  if body.get("min_p") is not None:
    fields["min_p"] = _number("min_p", body["min_p"], 0.0, 1.0)
  fields["stop"] = _stop(body.get("stop"))
  if body.get("n") is not None:
    fields["n"] = _int("n", body["n"], 1, max_n)
  logprobs = body.get("logprobs")
  if logprobs is not None:
    fields["logprobs"] = _bool("logprobs", logprobs) if chat else _int("logprobs", logprobs, 0, 1) is not None
  fields["seed"] = _int("seed", body.get("seed"), -(1 << 63), (1 << 64) - 1, none=True)
  if body.get("stream") is not None:
    fields["stream"] = _bool("stream", body["stream"])
  options = body.get("stream_options")
  if options is not None:
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
      raise ApiError(400, "'stream_options' takes only {\"include_usage\": bool}", param="stream_options")
    fields["include_usage"] = _bool("stream_options.include_usage", options.get("include_usage", False))
  if body.get("return_token_ids") is not None:
    fields["return_token_ids"] = _bool("return_token_ids", body["return_token_ids"])
  if body.get("user") is not None:
    fields["user"] = _str("user", body["user"])
  return Call(**fields)
