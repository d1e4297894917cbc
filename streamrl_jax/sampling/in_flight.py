"""One request's progress while it is in flight: on a slot, parked off it on a tool, or preempted and queued
again. Its completion so far leaves as a `Rollout` (handed over) or, finished, as a `Sample`."""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.streaming.shard import ROUTES_DTYPE
from streamrl_jax.types import Request, Rollout, Sample, SamplingParams


@dataclasses.dataclass
class InFlight:
  """One request's completion so far and where its row stands. `completion_tokens` and the per-token lists after it
  (logprobs, versions, loss_mask) are the completion's only; the prompt is `request.prompt_tokens`."""

  request: Request
  admit_time: float
  completion_tokens: list = dataclasses.field(default_factory=list)  # the completion's token ids so far
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)  # the policy version of each token
  first: object = None  # ((token, logprob, done) device arrays of its prefill call, its row), read at the next sync
  cache_end: int = 0  # upper bound of the slot's next cache write index
  resumed: bool = False  # admitted again after a preemption: its first token is one it had already
  loss_mask: list = dataclasses.field(default_factory=list)  # per token: the model's (True) or an environment's
  env_state: object = None  # multi-turn: the environment's state of this episode
  turn_start: int = 0  # multi-turn: where the model's current turn began in `completion_tokens`
  waiting: object = None  # multi-turn: the Future of the tool call the row is paused on
  env_reward: float = 0.0
  # a mixture of experts: per position of prompt + completion, the experts + 1 [sparse layers, k] a step routed it to
  # (None: not recorded yet); `routes_at` is (first position, count) of those its pending `first` call holds
  routes: list = dataclasses.field(default_factory=list)
  routes_at: tuple = (0, 0)

  @classmethod
  def resuming(cls, request: Request, now: float, progress: Rollout) -> InFlight:
    """A partial rollout handed over: it goes on after its completion tokens so far, which keep their
    log-probabilities, versions and loss mask (None: every one the model's)."""
    done = progress.completion_tokens
    mask = [True] * len(done) if progress.loss_mask is None else list(progress.loss_mask)
    return cls(request, now, list(done), list(progress.logprobs), list(progress.versions), loss_mask=mask)

  def prefill_input(self) -> tuple[np.ndarray, tuple[int, int]]:
    """(tokens to prefill, resume) to admit it again: its prompt and completion so far but its last token, which
    is the next input (resume = (that token, tokens generated))."""
    done = self.completion_tokens
    so_far = np.asarray(done[:-1], np.int32)
    return np.concatenate([self.request.prompt_tokens, so_far]), (done[-1], len(done))

  @property
  def remaining(self) -> int:
    """Tokens it may still sample (its first, sampled but not read yet, counted as sampled)."""
    return (self.request.params.max_new_tokens - len(self.completion_tokens)
            - (self.first is not None and not self.resumed))

  def add(self, token, logprob, version: int) -> None:
    """Records one token the model sampled."""
    self.completion_tokens.append(int(token))
    self.logprobs.append(float(logprob))
    self.versions.append(version)
    self.loss_mask.append(True)

  def place_routes(self, start: int, experts: np.ndarray) -> None:
    """Records the experts [count, sparse layers, k] (ids, as an engine gives them; -1: not computed) that a call
    routed positions `start`.. of prompt + completion to; a later call's routes of a position replace an earlier
    one's."""
    end = start + len(experts)
    if len(self.routes) < end:
      self.routes.extend([None] * (end - len(self.routes)))
    for position, chosen in enumerate(np.asarray(experts), start):
      if (chosen >= 0).all():  # -1: the call did not compute it (a prompt the prefix cache held)
        self.routes[position] = (chosen + 1).astype(ROUTES_DTYPE)

  def prompt_routes(self) -> list | None:
    """The routes of every prompt position, when all are recorded (else None)."""
    prompt = self.routes[:len(self.request.prompt_tokens)]
    return prompt if len(prompt) == len(self.request.prompt_tokens) and all(r is not None for r in prompt) else None

  def _routes_array(self) -> np.ndarray | None:
    """[prompt + completion, sparse layers, k] of the recorded routes (0 where none), or None without any."""
    recorded = [r for r in self.routes if r is not None]
    if not recorded:
      return None
    length = len(self.request.prompt_tokens) + len(self.completion_tokens)
    out = np.zeros((length,) + recorded[0].shape, ROUTES_DTYPE)
    for position, r in enumerate(self.routes[:len(out)]):
      if r is not None:
        out[position] = r
    return out

  def observe(self, tokens, version: int) -> None:
    """Records an environment's tokens (loss mask 0); the model's next turn starts after them."""
    self.completion_tokens.extend(tokens)
    self.logprobs.extend([0.0] * len(tokens))
    self.versions.extend([version] * len(tokens))
    self.loss_mask.extend([False] * len(tokens))
    self.turn_start = len(self.completion_tokens)

  def rollout(self) -> Rollout:
    """Its completion so far as a `Rollout` (loss mask None: every token the model's); an episode with an
    environment's tokens gives none (its environment's state stays here, so it starts again elsewhere)."""
    request, keep = self.request, all(self.loss_mask) and self.waiting is None
    return Rollout(request.group_id, request.sample_index, tuple(self.completion_tokens) if keep else (),
                   tuple(self.logprobs) if keep else (), tuple(self.versions) if keep else ())

  def sample(self, reason: str, instance: int, now: float) -> Sample:
    """The finished `Sample` (finished at `now` on engine instance `instance`)."""
    request = self.request
    return Sample(
        request_id=request.request_id, group_id=request.group_id, sample_index=request.sample_index,
        prompt_tokens=request.prompt_tokens, completion_tokens=np.asarray(self.completion_tokens, np.int32),
        logprobs=np.asarray(self.logprobs, np.float32), versions=np.asarray(self.versions, np.int64),
        finish_reason=reason, first_version=min(self.versions), last_version=max(self.versions), instance=instance,
        submit_time=request.submit_time, admit_time=self.admit_time, finish_time=now,
        loss_mask=None if all(self.loss_mask) else np.asarray(self.loss_mask, bool), env_reward=self.env_reward,
        routes=self._routes_array())


def check_resumable(progress: Rollout, params: SamplingParams) -> None:
  """Raises unless `progress` (some completion tokens) is a partial rollout that `params` can go on from."""
  if params.num_samples != 1:
    raise ValueError(f"a partial rollout resumes one sample; got num_samples={params.num_samples}")
  done = progress.completion_tokens
  if len(done) >= params.max_new_tokens or done[-1] in params.stop_token_ids:
    raise ValueError(f"a partial rollout of {len(done)} tokens (last {done[-1]}) is "
                     f"finished already (max_new_tokens={params.max_new_tokens}, stop ids "
                     f"{list(params.stop_token_ids)}): nothing to resume")
