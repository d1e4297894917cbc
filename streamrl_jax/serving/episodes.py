"""Token-exact transcripts of agent episodes: the turns an agent program asks for under one episode tag become one
sample, built from the token ids that were sampled, never from a re-tokenization of the text sent back.

An episode's next request must continue its conversation: rendered (the chat template, or the text prompt), it
starts with the text of everything so far, the last reply included. Only what follows is encoded (the environment's
or user's messages and the template's own tokens, loss mask 0); the replies keep their sampled ids (loss mask 1).
A template that renders earlier turns differently (Qwen3's drops past reasoning) does not start so: the request's
messages must then start with the episode's messages so far, its replies as sent (the conversation is the same), and
what follows the sampled tokens is what the template renders after the last reply in this conversation (found by
rendering it with the reply's content a probe); it is counted (`prefix_mismatches`), and the episode goes on from
the ids that were sampled, never from a re-rendering. The transcripts are owned by the server's
event loop; a sampler opens and closes them through it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from streamrl_jax.agents.program import EPISODE_HEADER
from streamrl_jax.serving.protocol import ApiError
from streamrl_jax.serving.text_stream import ChoiceText

_PROBE = "\x00streamrl-reply\x00"  # a reply's content when a conversation is rendered to find what follows it


@dataclasses.dataclass
class Transcript:
  """One episode so far: its first prompt's ids, then every later token with its mask, log-probability and
  version; `text`: the conversation rendered through the last reply."""

  tag: str
  budget: int  # the most tokens after the first prompt
  prompt_tokens: list[int] = dataclasses.field(default_factory=list)
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[bool] = dataclasses.field(default_factory=list)
  text: str = ""
  reply: str = ""  # the text of the last reply
  stop_text: str = ""  # what ended the last reply, as sampled: a stop token's text or a stop string ("": length)
  turns: int = 0
  busy: bool = False  # a turn is being generated (an episode's turns come one at a time)
  finish_reason: str = ""
  prefix_mismatches: int = 0  # turns whose rendering changed the text already sampled (placed by the history)
  messages: tuple = ()  # a chat episode's messages so far, its last reply as sent included


@dataclasses.dataclass(frozen=True)
class Turn:
  """A turn being generated: the ids added before it (loss mask False) and the whole prompt it is generated from."""

  tag: str
  rendered: str
  added: tuple[int, ...]
  prompt_tokens: np.ndarray
  room: int  # tokens it may generate within the episode's budget
  messages: tuple = ()  # a chat request's messages


class Episodes:
  """The open transcripts, by tag. `token_text(id)` is a token's text as a template writes it (a stop token's)."""

  def __init__(self, encode: Callable[[str], list[int]], token_text: Callable[[int], str],
               decode: Callable[[list[int]], str], render: Callable[[list], str] | None = None):
    """`render(messages)`: the chat template over messages, as a request is rendered (None: a model without one,
    whose episodes must continue their text)."""
    self._encode, self._token_text, self._decode = encode, token_text, decode
    self._render = render
    self._open: dict[str, Transcript] = {}

  def open(self, tag: str, budget: int) -> None:
    if tag in self._open:
      raise KeyError(f"episode {tag!r} is open already")
    self._open[tag] = Transcript(tag, budget)

  def close(self, tag: str) -> Transcript | None:
    """Ends an episode and returns its transcript (None if it was never opened)."""
    return self._open.pop(tag, None)

  def __contains__(self, tag: str) -> bool:
    return tag in self._open

  def begin(self, tag: str, rendered: str, encode_first: Callable[[str], list[int]], n: int,
            messages: tuple | None = None) -> Turn:
    """The next turn of episode `tag` from its request's rendered text and (a chat request) its messages. An unknown
    tag, a second turn at once, a conversation that does not continue the episode's, or a spent budget raise
    `ApiError`."""
    t = self._open.get(tag)
    if t is None:
      raise ApiError(400, f"unknown episode {tag!r} (not open on this sampler, or ended)", param=EPISODE_HEADER,
                     code="unknown_episode")
    if n != 1:
      raise ApiError(400, f"episode {tag!r}: an episode's request has one choice (n=1), got n={n}", param="n")
    if t.busy:
      raise ApiError(409, f"episode {tag!r}: turn {t.turns + 1} is being generated already; an episode's turns "
                          "come one at a time", param=EPISODE_HEADER, code="episode_busy")
    if t.turns == 0:
      prompt, added = list(encode_first(rendered)), ()
    else:
      rest = self._after_reply(t, rendered, messages)
      same = next((i for i, (a, b) in enumerate(zip(rest, t.stop_text)) if a != b), min(len(rest), len(t.stop_text)))
      rest = rest[same:]  # as far as it repeats what ended the reply, the sampled tokens stand for it
      added = tuple(self._encode(rest)) if rest else ()
      prompt = t.prompt_tokens + t.tokens + list(added)
    room = t.budget - len(t.tokens) - len(added)
    if room < 1:
      raise ApiError(400, f"episode {tag!r} has used its {t.budget} tokens; end the episode",
                     param="max_tokens", code="episode_budget")
    t.busy = True
    return Turn(tag, rendered, added, np.asarray(prompt, np.int32), room, tuple(messages or ()))

  def record(self, turn: Turn, choice: ChoiceText) -> None:
    """A turn's reply, as sampled: the ids added before it (mask 0, the reply's first version) and its tokens."""
    t = self._open.get(turn.tag)
    if t is None:
      return  # closed while the turn ran: the sampler has its transcript already
    if t.turns == 0:
      t.prompt_tokens = [int(i) for i in turn.prompt_tokens]
    version = choice.versions[0] if choice.versions else (t.versions[-1] if t.versions else 0)
    t.tokens += list(turn.added) + choice.tokens
    t.logprobs += [0.0] * len(turn.added) + choice.logprobs
    t.versions += [version] * len(turn.added) + choice.versions
    t.loss_mask += [False] * len(turn.added) + [True] * len(choice.tokens)
    t.text, t.reply = turn.rendered + choice.text, choice.text
    t.messages = turn.messages + ({"role": "assistant", "content": choice.text},) if turn.messages else ()
    if choice.stopped_on_token:
      t.stop_text = self._token_text(choice.tokens[-1])
    elif choice.finish_reason == "stop":  # a stop string: its text as sampled (the reply's text leaves it out)
      t.stop_text = self._decode(choice.tokens)[len(choice.text):]
    else:
      t.stop_text = ""
    t.turns, t.busy, t.finish_reason = t.turns + 1, False, choice.finish_reason or ""

  def _after_reply(self, t: Transcript, rendered: str, messages: tuple | None) -> str:
    """The text of a turn's request after the episode's last reply: after the text so far where the request
    continues it; else (a template that renders earlier turns anew), when the request's messages start with the
    episode's, what the template renders after that reply in this conversation (the reply's content a probe). A
    conversation that does neither raises `ApiError`."""
    if rendered.startswith(t.text):
      return rendered[len(t.text):]
    same = messages is not None and t.messages and tuple(messages[:len(t.messages)]) == t.messages
    after = None
    if same and self._render is not None:
      probed = [*messages[:len(t.messages) - 1], {**t.messages[-1], "content": _PROBE}, *messages[len(t.messages):]]
      text = self._render(probed)
      after = text.split(_PROBE, 1)[1] if text.count(_PROBE) == 1 else None
    if after is None:
      at = next((i for i, (a, b) in enumerate(zip(rendered, t.text)) if a != b), min(len(rendered), len(t.text)))
      raise ApiError(400, f"episode {t.tag!r} turn {t.turns + 1}: the conversation does not continue the one its "
                          f"last reply was sampled in (they differ at character {at}); send the earlier messages "
                          "and replies back unchanged", param="messages", code="episode_diverged")
    t.prefix_mismatches += 1
    return after

  def abort(self, turn: Turn) -> None:
    """A turn that did not finish (refused, cancelled, timed out): the episode goes on as before it."""
    t = self._open.get(turn.tag)
    if t is not None:
      t.busy = False

