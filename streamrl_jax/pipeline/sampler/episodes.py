"""A sampler worker's agent episodes (`EnvConfig.agent`): `group_size` per leased prompt, run by agent workers
against the sampler's server; each finished one a sample of its group, and one that failed scored 0 here."""

from __future__ import annotations

import dataclasses
import logging

from streamrl_jax.envs import EnvConfig
from streamrl_jax.messages import Lease
from streamrl_jax.agents.rollouts import AgentRollouts, Failure, episode_sample, failure_score, scored_text
from streamrl_jax.rewards.scorer import RewardError
from streamrl_jax.run_shape import RunShape
from streamrl_jax.tasks.rows import question

_log = logging.getLogger(__name__)

AGENT_FAILURES_SHOWN = 3  # failed episodes named in the log (the rest are counted)


class LeaseEpisodes:
  """The episodes of the leases in hand; the agent workers start with the first and stop with `close`. `env` names
the agent program; each episode has the run's `max_new_tokens` and a prompt `group_size` episodes."""

  def __init__(self, env: EnvConfig, shape: RunShape, task, name: str):
    self.env, self.shape, self.task, self.name = env, shape, task, name
    self.agents: AgentRollouts | None = None
    self._failed: list = []  # (scorer key, Score) of failed episodes, sent out with the scored samples

  def start(self, lease: Lease, rows: list, server) -> None:
    """Starts `group_size` episodes of the agent program per leased prompt, against `server`."""
    if self.agents is None:
      self.agents = AgentRollouts(self.env, server, self.shape.max_new_tokens)
    for group_id, prompt, row in zip(lease.group_ids, lease.prompts, rows):
      self.agents.start((lease.lease_id, group_id), {"prompt": question(self.task, prompt), **row.fields},
                        self.shape.group_size)

  def finished(self, runs: dict, stop_id: int, version: int):
    """Each finished episode of a lease in hand (`runs`, by lease id) as (its run, its sample, the text its reward
    functions score, why it failed: "" when it did not)."""
    for result in self.agents.finished():
      lease_id, group_id = result.key
      run = runs.get(lease_id)
      if run is None:
        continue  # its lease was dropped
      prompt_tokens = run.lease.prompt_tokens[run.index_of[group_id]]
      if result.transcript is not None:  # turns a template rendered anew: counted in the lease's report
        run.template_prefix_mismatch += result.transcript.prefix_mismatches
      sample = episode_sample(result, group_id, prompt_tokens, stop_id, version)
      text, env_reward, failure = scored_text(result)
      yield run, dataclasses.replace(sample, env_reward=env_reward), text, failure

  def failed(self, key: tuple, failure: Failure, where: str, functions: int) -> None:
    """An episode that failed (`failure`: its kind and why) is scored 0 by each of the `functions` and counted; with
    `EnvConfig.agent_on_error='stop'` it stops the run (`RewardError`)."""
    message = f"agent {self.env.agent!r} {failure.why} on {where}"
    if self.env.agent_on_error == "stop":
      raise RewardError(f"{message} (EnvConfig.agent_on_error='stop'; 'zero' scores such episodes 0 and counts "
                        "them in reward_errors)")
    failed = self.agents.counters.agent_failures + self.agents.counters.agent_timeouts
    if failed <= AGENT_FAILURES_SHOWN:
      _log.warning(f"{self.name}: {message}; scored 0, counted in reward_errors"
                   + (" (later failures are only counted)" if failed == AGENT_FAILURES_SHOWN else ""))
    self._failed.append((key, failure_score(failure, functions)))

  def take_scores(self) -> list:
    """The (scorer key, Score) of the episodes failed since the last call."""
    failed, self._failed = self._failed, []
    return failed

  def close(self) -> None:
    """Stops the agent workers (their episodes are not wanted); the next `start` starts them again."""
    if self.agents is not None:
      self.agents.close()
      self.agents = None
