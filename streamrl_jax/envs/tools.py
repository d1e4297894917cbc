"""A sampler's side of an environment: the steps of its episodes run on host threads, so a row waiting for a
tool never holds up the other rows' decoding, and observations come back as tokens to append to the row."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from streamrl_jax.counters import Counters
from streamrl_jax.envs.base import Environment, Observation
from streamrl_jax.envs.config import EnvConfig


@dataclasses.dataclass(frozen=True)
class ToolResult:
  state: Any
  tokens: tuple[int, ...]  # the observation, to append with loss mask 0
  reward: float
  done: bool


def stop_token_ids(tokenizer, stop: str) -> tuple[int, ...]:
  """Token ids that end a turn with `stop`: the one token of `stop`, or every vocabulary entry that decodes to
  it exactly."""
  try:
    encoded = tokenizer.encode(stop)
  except ValueError:
    encoded = []
  if len(encoded) == 1:
    return (int(encoded[0]),)
  vocab = getattr(tokenizer, "vocab", None)
  ids = sorted(i for i in (vocab.values() if vocab else ()) if tokenizer.decode([i]) == stop)
  if not ids:
    raise ValueError(f"no token of this tokenizer is the environment's stop text {stop!r}")
  return tuple(ids)


def encode_text(tokenizer, text: str) -> list[int]:
  """`text` as tokens; characters the tokenizer cannot encode become '?'."""
  try:
    return list(tokenizer.encode(text))
  except ValueError:
    safe = []
    for char in text:
      try:
        tokenizer.encode(char)
        safe.append(char)
      except ValueError:
        safe.append("?")
    return list(tokenizer.encode("".join(safe)))


@dataclasses.dataclass(slots=True, eq=False)
class ToolCounters(Counters):
  """Tool calls run and their seconds."""

  tool_calls: int = 0
  tool_s: float = 0.0


class ToolRunner:
  """Runs `env`'s steps for a sampler on `threads` host threads. `delay_s` is added to every step (to measure
  what slow tools cost)."""

  def __init__(self, env: Environment, tokenizer, *, threads: int = 8, delay_s: float = 0.0):
    self.env, self.tokenizer, self.delay_s = env, tokenizer, delay_s
    self.stop_ids = stop_token_ids(tokenizer, env.stop)
    self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tool")
    self.counters = ToolCounters()
    self._lock = threading.Lock()

  def start(self, prompt_tokens, seed: int) -> Any:
    return self.env.reset(self.tokenizer.decode(np.asarray(prompt_tokens).tolist()), seed)

  def submit(self, state, turn_tokens) -> Future:
    """The environment's step on a model turn (its tokens), on a host thread: a Future of a `ToolResult`."""
    return self._pool.submit(self._step, state, [int(t) for t in turn_tokens])

  def _step(self, state, turn_tokens: list[int]) -> ToolResult:
    start = time.perf_counter()
    if self.delay_s:
      time.sleep(self.delay_s)
    try:
      state, observation = self.env.step(state, self.tokenizer.decode(turn_tokens))
    except Exception as err:  # noqa: BLE001 - an environment's failure ends its episode, not the sampler
      state, observation = state, Observation(f"error: {type(err).__name__}", done=True)
    tokens = () if observation.done else tuple(encode_text(self.tokenizer, observation.text))
    with self._lock:
      self.counters.tool_calls += 1
      self.counters.tool_s += time.perf_counter() - start
    return ToolResult(state, tokens, observation.reward, observation.done)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


def make_tools(config: EnvConfig, tokenizer) -> ToolRunner | None:
  """The tool runner of an `EnvConfig`, or None without an environment."""
  if not config.environment:
    return None
  from streamrl_jax.envs.catalog import make_environment
  return ToolRunner(make_environment(config.environment, max_turns=config.max_turns), tokenizer,
                    threads=config.tool_threads, delay_s=config.tool_delay_s)
