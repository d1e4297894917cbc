"""A sampler's agent episodes: each leased prompt's `group_size` episodes of the user's agent program run in agent
worker processes against this sampler's OpenAI-compatible server; each finished episode's transcript (its turns'
sampled ids, trained; everything between, masked) becomes one `Sample` of its group.

The server shares the sampler's engine through its `RequestBridge`; the transcripts live on the server's event loop
and are opened and closed through it (`ServerThread.call`). An episode that fails (raises, hangs past its limit,
returns garbage, or its worker dies) still becomes a sample: its turns so far (or one masked stop token), scored 0
and counted, so no group is ever short."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import secrets
from typing import NamedTuple

import numpy as np

from streamrl_jax.counters import Counters
from streamrl_jax.envs import EnvConfig
from streamrl_jax.agents.program import FAILED, POLICY_MODEL, TIMED_OUT, run_group
from streamrl_jax.rewards.scorer import Score, worker_pool
from streamrl_jax.sampling.config import SamplerConfig
from streamrl_jax.serving.app import ServedModel, Service
from streamrl_jax.serving.bridge import RequestBridge
from streamrl_jax.serving.config import ServeConfig
from streamrl_jax.serving.episodes import Transcript
from streamrl_jax.serving.server import ServerThread
from streamrl_jax.types import FINISH_STOP, Sample

_log = logging.getLogger(__name__)

TASK_MARGIN_S = 5.0  # past an episode's own limit, how long its worker may take before it is killed


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
  """One finished episode: its group's key, sample index, outcome (kind, value) and transcript (None: no turn)."""

  key: tuple
  index: int
  outcome: tuple[str, object]
  transcript: Transcript | None


def sampler_server(sampler: SamplerConfig, serve: ServeConfig | None, tokenizer, tls=None, name: str = "sampler"):
  """(bridge, server) of a sampler worker that serves clients (`serve`) or runs an agent program; (None, None)
  otherwise. An agent's sampler answers to `POLICY_MODEL`, the name agents ask for."""
  if serve is None and not sampler.env.agent:
    return None, None
  bridge = RequestBridge(before_leases=serve is None or serve.priority == "before_leases")
  served_name = POLICY_MODEL if sampler.env.agent or not serve.model_name else serve.model_name
  served = ServedModel(served_name, tokenizer, sampler.engine.max_prompt_length, sampler.engine.max_new_tokens)
  server = serving_for(serve, served, bridge, tls)
  _log.info(f"{name}: OpenAI-compatible API at {server.base_url} (model {served_name!r})")
  return bridge, server


class Failure(NamedTuple):
  """Why an episode failed: its kind (`FAILED`, or `TIMED_OUT`: it ran past its limit, or its worker was killed
  for it) and the words that say so."""
  kind: str
  why: str


def failure_score(failure: Failure, functions: int) -> Score:
  """The score of an episode that failed: 0 from each of the `functions` reward functions, counted as a timeout or
  an error by its kind."""
  timed_out = failure.kind == TIMED_OUT
  return Score(0.0, (0.0,) * functions, errors=int(not timed_out), timeouts=int(timed_out))


def serving_for(config: ServeConfig | None, model: ServedModel, bridge: RequestBridge, tls=None) -> ServerThread:
  """The sampler's server: `config`'s, or (for agents alone) one on a free local port with a random key."""
  if config is None:
    config = ServeConfig(port=0, api_key=secrets.token_hex(16), max_requests=4096)
  service = Service(model, config, bridge)
  return ServerThread(service, tls=tls)


@dataclasses.dataclass(slots=True, eq=False)
class AgentCounters(Counters):
  """Agent episodes run, failed and timed out."""

  agent_episodes: int = 0
  agent_failures: int = 0
  agent_timeouts: int = 0


class AgentRollouts:
  """The episodes of the leases in hand. `start` a group, `finished()` the episodes that ended."""

  def __init__(self, env_config: EnvConfig, server: ServerThread, budget: int):
    from streamrl_jax.agents.program import load_agent

    load_agent(env_config.agent)  # refuses a missing or wrong function here, in one line
    self.config, self.server, self.budget = env_config, server, budget
    self._pool = None
    self._groups: dict = {}  # future -> (key, tags)
    self.counters = AgentCounters()

  def _workers(self):
    if self._pool is None:
      self._pool = worker_pool(self.config.agent_workers)
    return self._pool

  def start(self, key: tuple, row: dict, episodes: int) -> None:
    """Starts `episodes` episodes of one prompt `row` (its `prompt` and columns) for the group `key`."""
    tags = [f"{secrets.token_hex(6)}-{'-'.join(map(str, key))}-{k}" for k in range(episodes)]
    for tag in tags:
      self.server.call(self.server.service.episodes.open, tag, self.budget)
    service = self.server.service
    future = self._workers().schedule(
        run_group, args=(self.config.agent, self.server.base_url, service.config.api_key, tags, row,
                         self.config.agent_timeout_s), timeout=self.config.agent_timeout_s + TASK_MARGIN_S)
    self._groups[future] = (key, tags)
    self.counters.agent_episodes += episodes

  @property
  def running(self) -> int:
    return len(self._groups)

  def wait(self, timeout: float) -> None:
    """Blocks until a group's episodes end, or `timeout` s."""
    if self._groups:
      concurrent.futures.wait(list(self._groups), timeout, return_when=concurrent.futures.FIRST_COMPLETED)

  def finished(self) -> list[EpisodeResult]:
    """The episodes of every group whose worker task has ended, with their transcripts (closed)."""
    out = []
    for future in [f for f in self._groups if f.done()]:
      key, tags = self._groups.pop(future)
      try:
        outcomes = future.result()
      except TimeoutError:
        outcomes = [(TIMED_OUT, f"its worker ran past EnvConfig.agent_timeout_s={self.config.agent_timeout_s} "
                                f"+ {TASK_MARGIN_S:.0f} s and was killed")] * len(tags)
      except Exception as err:  # noqa: BLE001 - the worker died (the user's code ended its process)
        outcomes = [(FAILED, f"its worker process died: {type(err).__name__}: {err}")] * len(tags)
      for index, (tag, outcome) in enumerate(zip(tags, outcomes)):
        transcript = self.server.call(self.server.service.episodes.close, tag)
        self.counters.agent_failures += outcome[0] == FAILED
        self.counters.agent_timeouts += outcome[0] == TIMED_OUT
        out.append(EpisodeResult(key, index, outcome, transcript))
    return out

  def close(self) -> None:
    """Stops the workers (episodes running are abandoned) and the transcripts they had open."""
    if self._pool is not None:
      self._pool.stop()
      self._pool.join(timeout=10)
      self._pool = None
    for _, tags in self._groups.values():
      for tag in tags:
        self.server.call(self.server.service.episodes.close, tag)
    self._groups.clear()


def scored_text(result: EpisodeResult) -> tuple[str | None, float, Failure | None]:
  """(what the reward functions score, the episode's own reward, why it failed (None: it did not)) of an episode:
  an answer is scored as it is; a reward is added to the functions' score of the last reply; a failure is
  scored 0 (text None)."""
  kind, value = result.outcome
  if kind in (FAILED, TIMED_OUT):
    return None, 0.0, Failure(kind, str(value))
  if isinstance(value, str):
    return value, 0.0, None
  return (result.transcript.reply if result.transcript is not None else ""), float(value), None


def episode_sample(result: EpisodeResult, group_id: int, prompt_tokens, stop_id: int, version: int) -> Sample:
  """The sample of one episode: its first prompt, then every later token (replies trained, the rest masked). An
  episode with no turn is its row's prompt and one masked stop token (it trains nothing; its reward is 0)."""
  t = result.transcript
  if t is None or t.turns == 0:
    prompt, ids, logprobs, versions, mask, reason = list(prompt_tokens), [stop_id], [0.0], [version], [False], FINISH_STOP
  else:
    prompt, ids, logprobs, versions, mask, reason = t.prompt_tokens, t.tokens, t.logprobs, t.versions, t.loss_mask, t.finish_reason
  return Sample(request_id=-1, group_id=group_id, sample_index=result.index,
                prompt_tokens=np.asarray(prompt, np.int32), completion_tokens=np.asarray(ids, np.int32),
                logprobs=np.asarray(logprobs, np.float32), versions=np.asarray(versions, np.int64),
                finish_reason=reason or FINISH_STOP, first_version=min(versions), last_version=max(versions),
                loss_mask=np.asarray(mask, bool))


__all__ = ["AgentRollouts", "EpisodeResult", "Failure", "episode_sample", "failure_score", "sampler_server",
           "scored_text", "serving_for"]
