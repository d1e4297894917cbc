"""Agent programs as rollouts: a user's `async def run(client, prompt_row)` plays an episode against the policy
through an `openai.AsyncOpenAI` client whose calls the sampler serves and records (`serving.episodes`).

This module is the worker-process side: a sampler hands a group's episodes to an agent worker process
(`run_group`), which runs them concurrently on one event loop, each with its own client tagged with its episode
(the `x-streamrl-episode` header) and its own time limit, and returns each outcome checked: a number is the
episode's reward, a string its final answer for the reward functions, anything else (or an exception, or running
past the limit) a failure named in one line. The function's module is imported once per worker process."""

from __future__ import annotations

import asyncio
import inspect
import math

from streamrl_jax.rewards.functions import RewardFunctionError, load_function

EPISODE_HEADER = "x-streamrl-episode"  # the header that tags a request with its episode
POLICY_MODEL = "policy"  # the model name an agent asks the sampler's server for

REWARD, ANSWER, FAILED, TIMED_OUT = "reward", "answer", "failed", "timed out"


def load_agent(spec: str):
  """The agent function at `spec` ('package.module:function' or 'path/to/file.py:function'), checked to be an
  `async def` of two parameters (client, prompt_row)."""
  try:
    fn = load_function(spec)
  except RewardFunctionError as err:
    raise ValueError(str(err).replace("reward function", "agent", 1)) from None
  if not inspect.iscoroutinefunction(fn):
    raise ValueError(f"agent {spec!r} must be an `async def run(client, prompt_row)`, got a plain function")
  try:
    inspect.signature(fn).bind(None, {})
  except TypeError as err:
    raise ValueError(f"agent {spec!r} cannot be called as run(client, prompt_row): {err}") from None
  return fn


def checked_outcome(value) -> tuple[str, object]:
  """(REWARD, float), (ANSWER, str) or (FAILED, why) of what an agent returned."""
  if isinstance(value, str):
    return ANSWER, value
  if isinstance(value, (int, float)) and not isinstance(value, complex):
    value = float(value)
    if math.isfinite(value):
      return REWARD, value
    return FAILED, f"returned {value}, not a finite reward"
  return FAILED, (f"returned a {type(value).__name__}; an agent returns its reward (a number) or its final "
                  "answer (a string)")


async def _episode(fn, base_url: str, api_key: str, tag: str, row: dict, timeout_s: float, client_options: dict):
  import openai

  client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, default_headers={EPISODE_HEADER: tag},
                              max_retries=0, timeout=timeout_s, **client_options)
  try:
    value = await asyncio.wait_for(fn(client, dict(row)), timeout_s)
  except asyncio.TimeoutError:
    return TIMED_OUT, f"ran past EnvConfig.agent_timeout_s={timeout_s}"
  except Exception as err:  # noqa: BLE001 - the user's program failed: its episode fails, the sampler goes on
    return FAILED, f"raised {type(err).__name__}: {str(err)[:300]}"
  finally:
    await client.close()
  return checked_outcome(value)


def run_group(spec: str, base_url: str, api_key: str, tags: list[str], row: dict, timeout_s: float,
              client_options: dict | None = None) -> list[tuple[str, object]]:
  """In an agent worker process: one episode per tag of one prompt row, concurrently; each one's outcome."""
  try:
    fn = load_agent(spec)
  except ValueError as err:
    return [(FAILED, str(err))] * len(tags)

  async def main():
    return await asyncio.gather(*(_episode(fn, base_url, api_key, tag, row, timeout_s, client_options or {})
                                  for tag in tags))
  return asyncio.run(main())
