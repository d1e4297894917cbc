"""`RewardScorer`: scores finished samples off the decode loop and says which are done.

Each sample's functions run as they finish: in `workers` processes (a call past `timeout_s` has its worker
replaced), or in the caller's thread with `workers=0`, or, with no function configured, the task's own verifier
in the caller's thread. A call that raises, hangs or returns no finite number stops the run (`on_error='stop'`:
`RewardError` naming the function, the sample's row and the problem) or scores 0, counted (`'zero'`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import signal
import time
from collections.abc import Callable, Hashable

from streamrl_jax.counters import Counters
from streamrl_jax.rewards import functions
from streamrl_jax.rewards.config import RewardConfig

TIMED_OUT = "timed out"


class RewardError(ValueError):
  """A reward function failed on a sample and `RewardConfig.on_error` is 'stop' (a user's error: one line)."""


@dataclasses.dataclass(frozen=True)
class Score:
  """A sample's reward: the weighted `total`, each function's value, and how many calls failed (scored 0)."""

  total: float
  parts: tuple[float, ...]
  errors: int = 0  # calls that raised or returned no finite number
  timeouts: int = 0  # calls past timeout_s


@dataclasses.dataclass
class _Pending:
  where: str
  results: list  # per function: ("ok", value) | ("bad", problem) | a future


@dataclasses.dataclass(slots=True, eq=False)
class RewardCounters(Counters):
  """Reward function calls, and those that raised or timed out."""

  reward_calls: int = 0
  reward_errors: int = 0
  reward_timeouts: int = 0


class RewardScorer:
  """submit(key, ...) as samples finish; done() gives the (key, Score) of those whose every call is back. A context
  manager: leaving it stops the workers."""

  def __init__(self, config: RewardConfig, builtin: Callable[[str, str, dict], float] | None = None):
    if not config.functions and builtin is None:
      raise ValueError("no reward: RewardConfig.functions is empty and the task has no verifier of its own")
    self.config, self.builtin = config, builtin
    self.names, self.weights = config.names, config.function_weights
    self._pending: dict[Hashable, _Pending] = {}
    self._pool = None
    self.counters = RewardCounters()

  @property
  def in_workers(self) -> bool:
    return bool(self.config.functions) and self.config.workers > 0

  def _workers(self):
    if self._pool is None:
      self._pool = worker_pool(self.config.workers)
    return self._pool

  def submit(self, key: Hashable, prompt: str, completion: str, fields: dict, where: str) -> None:
    """Starts scoring one sample; `where` names it in errors (its dataset row, step and group)."""
    if key in self._pending:
      raise KeyError(f"sample {key} is being scored already")
    if not self.config.functions:
      results = [functions.checked_call(lambda p, c, **f: self.builtin(p, c, f), prompt, completion, fields)]
    elif self.in_workers:
      pool = self._workers()
      results = [pool.schedule(functions.call, args=(spec, prompt, completion, fields), timeout=self.config.timeout_s)
                 for spec in self.config.functions]
    else:
      results = [functions.call(spec, prompt, completion, fields) for spec in self.config.functions]
    self.counters.reward_calls += len(results)
    self._pending[key] = _Pending(where, results)

  @property
  def pending(self) -> int:
    return len(self._pending)

  def done(self) -> list[tuple[Hashable, Score]]:
    """The samples whose every call is back, scored (and forgotten); raises `RewardError` on a failed call
    when on_error is 'stop'."""
    out = []
    for key, pending in list(self._pending.items()):
      if all(not isinstance(r, concurrent.futures.Future) or r.done() for r in pending.results):
        del self._pending[key]
        out.append((key, self._score(pending)))
    return out

  def wait(self, timeout: float) -> None:
    """Blocks until some pending call is back, or `timeout` s."""
    futures = [r for p in self._pending.values() for r in p.results if isinstance(r, concurrent.futures.Future)]
    if futures:
      concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

  def score(self, prompt: str, completion: str, fields: dict, where: str) -> Score:
    """One sample scored now (blocking)."""
    key = ("score", time.perf_counter_ns())
    self.submit(key, prompt, completion, fields, where)
    while True:
      for done_key, score in self.done():
        if done_key == key:
          return score
      self.wait(1.0)

  def _score(self, pending: _Pending) -> Score:
    parts, errors, timeouts = [], 0, 0
    for name, result in zip(self.names, pending.results):
      status, value = _outcome(result)
      if status == "ok":
        parts.append(value)
        continue
      if self.config.on_error == "stop":
        raise RewardError(f"reward function {name!r} {value} on {pending.where} (RewardConfig.on_error='stop'; "
                          "'zero' scores such calls 0 and counts them)")
      parts.append(0.0)
      if value.startswith(TIMED_OUT):
        timeouts += 1
      else:
        errors += 1
    self.counters.reward_errors += errors
    self.counters.reward_timeouts += timeouts
    total = float(sum(w * p for w, p in zip(self.weights, parts)))
    return Score(total, tuple(parts), errors, timeouts)

  def __enter__(self) -> RewardScorer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stops the workers (a call still running is abandoned)."""
    if self._pool is not None:
      self._pool.stop()
      self._pool.join(timeout=10)
      self._pool = None
    self._pending.clear()


def _outcome(result) -> tuple[str, object]:
  if not isinstance(result, concurrent.futures.Future):
    return result
  try:
    return result.result()
  except TimeoutError:
    return "bad", f"{TIMED_OUT} (RewardConfig.timeout_s; its worker was replaced)"
  except Exception as err:  # noqa: BLE001 - the worker died (os._exit, a crash) or could not take the call
    exitcode = getattr(err, "exitcode", None)
    return "bad", (f"ended its worker process (exit code {exitcode})" if exitcode is not None
                   else f"could not run: {type(err).__name__}: {err}")


def worker_pool(workers: int):
  """A pebble pool of `workers` processes for user code run off the sampler's thread (reward functions, agent
  programs): started by a fork server, never a fork of a process whose threads run JAX; each worker leaves Ctrl-C
  to its sampler."""
  import pebble

  context = multiprocessing.get_context("forkserver")
  context.set_forkserver_preload(["__main__", "streamrl_jax.rewards.functions"])  # main: once, not per worker
  return pebble.ProcessPool(max_workers=workers, context=context, initializer=_ignore_sigint)


def _ignore_sigint() -> None:
  """A worker leaves Ctrl-C to its sampler (which stops at a step boundary)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
