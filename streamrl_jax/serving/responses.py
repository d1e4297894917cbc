"""The JSON the server answers with, in OpenAI's shapes: whole completions, streamed chunks, usage, and the extension
fields (`weight_version` always; `token_ids`, `token_versions` and `prompt_token_ids` with `return_token_ids`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

from streamrl_jax.serving.protocol import Call
from streamrl_jax.serving.text_stream import ChoiceText


@dataclasses.dataclass(frozen=True)
class Reply:
  """What every part of one response shares."""

  call: Call
  id: str
  model: str
  created: int
  prompt_tokens: Sequence[int]
  token_text: Callable[[int], str]

  @classmethod
  def of(cls, call: Call, key: int, model: str, prompt_tokens, token_text) -> Reply:
    prefix = "chatcmpl" if call.chat else "cmpl"
    return cls(call, f"{prefix}-{key:x}", model, int(time.time()), [int(i) for i in prompt_tokens], token_text)

  @property
  def object(self) -> str:
    return "chat.completion" if self.call.chat else "text_completion"

  def logprobs(self, tokens: Sequence[int], logprobs: Sequence[float]) -> dict | None:
    if not self.call.logprobs:
      return None
    texts = [self.token_text(t) for t in tokens]
    if self.call.chat:
      return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                          for s, lp in zip(texts, logprobs)]}
    offsets, at = [], 0
    for s in texts:
      offsets.append(at)
      at += len(s)
    return {"tokens": texts, "token_logprobs": list(logprobs), "text_offset": offsets, "top_logprobs": None}

  def usage(self, choices: Sequence[ChoiceText]) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(self.prompt_tokens), "completion_tokens": completion,
            "total_tokens": len(self.prompt_tokens) + completion}

  def whole(self, choices: Sequence[ChoiceText]) -> dict:
    """The complete (not streamed) response."""
    out = []
    for index, c in enumerate(choices):
      choice = {"index": index, "logprobs": self.logprobs(c.tokens, c.logprobs), "finish_reason": c.finish_reason}
      if self.call.chat:
        choice["message"] = {"role": "assistant", "content": c.text}
      else:
        choice["text"] = c.text
      if self.call.return_token_ids:
        choice["token_ids"], choice["token_versions"] = list(c.tokens), list(c.versions)
      out.append(choice)
    body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": out,
            "usage": self.usage(choices), "weight_version": weight_version(choices)}
    if self.call.return_token_ids:
      body["prompt_token_ids"] = list(self.prompt_tokens)
    return body

  def chunk(self, index: int, text: str | None, tokens: Sequence[int], logprobs: Sequence[float],
            versions: Sequence[int], finish_reason: str | None, *, first: bool = False) -> dict:
    """One streamed chunk of choice `index`: new text (chat: the delta; the first chunk also gives the role)."""
    choice = {"index": index, "logprobs": self.logprobs(tokens, logprobs) if tokens else None,
              "finish_reason": finish_reason}
    if self.call.chat:
      delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
      choice["delta"] = delta
    else:
      choice["text"] = text or ""
    if self.call.return_token_ids:
      choice["token_ids"], choice["token_versions"] = list(tokens), list(versions)
    body = {"id": self.id, "object": f"{self.object}.chunk" if self.call.chat else self.object,
            "created": self.created, "model": self.model, "choices": [choice]}
    if versions:
      body["weight_version"] = max(versions)
    if first and self.call.return_token_ids:
      body["prompt_token_ids"] = list(self.prompt_tokens)
    return body

  def usage_chunk(self, choices: Sequence[ChoiceText]) -> dict:
    return {"id": self.id, "object": f"{self.object}.chunk" if self.call.chat else self.object,
            "created": self.created, "model": self.model, "choices": [], "usage": self.usage(choices),
            "weight_version": weight_version(choices)}


def weight_version(choices: Sequence[ChoiceText]) -> int:
  """The newest weight version among the response's tokens (-1: none sampled)."""
  return max((max(c.versions) for c in choices if c.versions), default=-1)


def sse(data: dict | str) -> bytes:
  """One server-sent event."""
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
