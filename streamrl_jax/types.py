"""Plain records that cross module boundaries: requests to the sampler and the samples it returns."""

from __future__ import annotations

import dataclasses

import numpy as np

FINISH_STOP = "stop"  # a stop token was sampled (it is the last completion token)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_TURNS = "turns"  # the environment ended the episode (its turn limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 switch those filters off."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely
  max_new_tokens: int = 64
  stop_token_ids: tuple[int, ...] = ()
  num_samples: int = 1  # GRPO group size: samples drawn per prompt

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 = off), got {self.min_p}")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.num_samples < 1:
      raise ValueError(f"SamplingParams.num_samples must be >= 1, got {self.num_samples}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One sample's generation as it travels: its completion's tokens so far (or all of them, `finished`; never the
  prompt), each with its log-probability, the policy version that sampled it and whether the model wrote it
  (`loss_mask`; None: every token the model's). The one record of a rollout between the driver, the wire and back:
  handed over by a sampler that leaves, resumed after its last token by the next, or (finished) scored as it is."""

  group_id: int
  sample_index: int
  completion_tokens: tuple[int, ...]  # the completion's token ids so far (the prompt is not here)
  logprobs: tuple[float, ...]  # one per completion token, under the distribution it was sampled from
  versions: tuple[int, ...]  # one per completion token: the policy version that sampled it
  loss_mask: tuple[bool, ...] | None = None  # one per completion token, False: an environment's; None: all True
  finished: bool = False

  def __post_init__(self):
    n = len(self.completion_tokens)
    if not n == len(self.logprobs) == len(self.versions):
      raise ValueError(f"Rollout of group {self.group_id}: {n} completion tokens, {len(self.logprobs)} "
                       f"log-probabilities and {len(self.versions)} versions; one of each per token")
    if self.loss_mask is not None and len(self.loss_mask) != n:
      raise ValueError(f"Rollout of group {self.group_id}: {len(self.loss_mask)} loss-mask entries for {n} "
                       "completion tokens (one per token; None: every token the model's)")


@dataclasses.dataclass(frozen=True)
class Request:
  """One sequence to generate. `group_id` ties the samples of one prompt together."""

  request_id: int
  prompt_tokens: np.ndarray  # int32 [prompt_len]
  params: SamplingParams
  group_id: int = 0
  sample_index: int = 0
  predicted_length: float | None = None  # from the ranker; admission policies may use it
  submit_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class Sample:
  """A finished generation, emitted the moment its last token is sampled. `completion_tokens` and the per-token
  fields (logprobs, versions, loss_mask) are the completion's only; the prompt's ids are `prompt_tokens`."""

  request_id: int
  group_id: int
  sample_index: int
  prompt_tokens: np.ndarray  # int32 [prompt_len]
  completion_tokens: np.ndarray  # int32 [n]: the completion's token ids (the prompt's are `prompt_tokens`)
  logprobs: np.ndarray  # float32 [n], under the sampling distribution used for each token
  versions: np.ndarray  # int64 [n]: the policy version that sampled each token
  finish_reason: str
  first_version: int  # the oldest policy version among its tokens' (the first token's, unless handed over)
  last_version: int  # ... and the newest
  instance: int = -1  # the engine instance that finished it (-1: it was finished on another sampler)
  submit_time: float | None = None  # None: not measured here (finished on another sampler)
  admit_time: float | None = None
  finish_time: float | None = None
  loss_mask: np.ndarray | None = None  # bool [n]: False for tokens an environment wrote (None: all the model's)
  env_reward: float = 0.0  # the environment's rewards of the episode, added to the task's
  # a mixture of experts: [prompt + n, sparse layers, k] int16, each token's experts + 1 at each sparse layer as the
  # sampler routed it (0: not recorded, as for the last token, which no step read); None: a dense model's
  routes: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return len(self.completion_tokens)

  def rollout(self) -> Rollout:
    """This sample as a finished `Rollout` (to hand over with its group)."""
    mask = None if self.loss_mask is None else tuple(bool(m) for m in self.loss_mask)
    return Rollout(self.group_id, self.sample_index, tuple(self.completion_tokens.tolist()),
                   tuple(self.logprobs.tolist()), tuple(self.versions.tolist()), mask, finished=True)

  @classmethod
  def of_rollout(cls, rollout: Rollout, prompt_tokens, stop_ids) -> Sample:
    """A finished rollout handed over by another sampler, as a sample (its timings were not measured here)."""
    reason = FINISH_STOP if rollout.completion_tokens[-1] in stop_ids else FINISH_LENGTH
    return cls(request_id=-1, group_id=rollout.group_id, sample_index=rollout.sample_index,
               prompt_tokens=np.asarray(prompt_tokens, np.int32),
               completion_tokens=np.asarray(rollout.completion_tokens, np.int32),
               logprobs=np.asarray(rollout.logprobs, np.float32), versions=np.asarray(rollout.versions, np.int64),
               finish_reason=reason, first_version=min(rollout.versions), last_version=max(rollout.versions),
               loss_mask=None if rollout.loss_mask is None else np.asarray(rollout.loss_mask, bool))
