"""One choice of a served request as its tokens arrive: the text they make, where a stop string ends it, and what
may be sent to a streaming client now (never half a character, never the start of a stop string)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
  """Where the earliest of `stops` begins in `text` (searching from `start`), or None."""
  hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
  return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
  """Characters at the end of `text` that could begin a stop string."""
  longest = 0
  for stop in stops:
    for k in range(min(len(stop) - 1, len(text)), longest, -1):
      if text.endswith(stop[:k]):
        longest = k
        break
  return longest


class ChoiceText:
  """Tokens, log-probabilities and versions of one choice so far, and their text (a trailing stop token left out).
  A stop string ends the choice at the token that completes it; its text ends before the stop string."""

  def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], stop_ids: Sequence[int]):
    self._decode, self.stops, self.stop_ids = decode, tuple(stops), frozenset(int(i) for i in stop_ids)
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[int] = []
    self.text = ""
    self.sent = 0  # characters of `text` handed out by `sendable`
    self.finish_reason: str | None = None

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def stopped_on_token(self) -> bool:
    """Whether its last token is a stop token (the text leaves it out)."""
    return bool(self.tokens) and self.tokens[-1] in self.stop_ids

  def add(self, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> bool:
    """Appends newly sampled tokens; True if a stop string ended the choice (the caller cancels its request)."""
    if self.done:
      return False
    start = len(self.tokens)
    self.tokens += [int(t) for t in tokens]
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [int(v) for v in versions]
    return self._scan(start)

  def finish(self, reason: str, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
    """The engine finished the choice (`reason` 'stop' or 'length') with all its tokens; a stop string among the
    ones not seen yet still ends it there."""
    if self.done:
      return
    seen = len(self.tokens)
    if not self.add(tokens[seen:], logprobs[seen:], versions[seen:]):
      self.finish_reason = reason

  def sendable(self) -> str:
    """The text not yet handed out that is final: all of it once done; before, none that may start a stop string
    or end in half a character."""
    end = len(self.text)
    if not self.done:
      end -= held_back(self.text, self.stops)
      while end > self.sent and self.text[end - 1] == REPLACEMENT:
        end -= 1
    chunk = self.text[self.sent:end] if end > self.sent else ""
    self.sent = max(self.sent, end)
    return chunk

  def _text_of(self, count: int) -> str:
    tokens = self.tokens[:count]
    if tokens and tokens[-1] in self.stop_ids:
      tokens = tokens[:-1]
    return self._decode(tokens)

  def _scan(self, start: int) -> bool:
    text = self._text_of(len(self.tokens))
    longest = max((len(s) for s in self.stops), default=0)
    if self.stops and first_stop(text, self.stops, max(0, len(self.text) - longest)) is not None:
      for count in range(start + 1, len(self.tokens) + 1):  # the token that completes the stop string
        text = self._text_of(count)
        hit = first_stop(text, self.stops, max(0, len(self.text) - longest))
        if hit is not None:
          del self.tokens[count:], self.logprobs[count:], self.versions[count:]
          self.text, self.finish_reason = text[:hit], "stop"
          return True
    self.text = text
    return False
