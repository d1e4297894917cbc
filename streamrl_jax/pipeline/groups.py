"""Turns finished samples into `SampleShard`s, one per complete group (GRPO needs whole groups)."""

from __future__ import annotations

import numpy as np

from streamrl_jax.streaming import SampleShard
from streamrl_jax.types import Sample


def samples_to_shard(samples: list[Sample], rewards, width: int, step: int) -> SampleShard:
  """Prompt + completion right-padded to `width`; logprobs aligned with the tokens they score; `step` is
  the RL step the samples were generated for."""
  n = len(samples)
  tokens = np.zeros((n, width), np.int32)
  valid = np.zeros((n, width), bool)
  loss_mask = np.zeros((n, width), bool)
  logprobs = np.zeros((n, width), np.float32)
  versions = np.zeros((n, width), np.int64)
  for row, s in enumerate(samples):
    p, c = len(s.prompt_tokens), len(s.completion_tokens)
    if p + c > width:
      raise ValueError(f"sample {s.request_id}: {p + c} tokens exceed the shard width {width}")
    tokens[row, :p], tokens[row, p:p + c] = s.prompt_tokens, s.completion_tokens
    valid[row, :p + c] = True
    loss_mask[row, p:p + c] = True if s.loss_mask is None else s.loss_mask  # an environment's tokens: False
    logprobs[row, p:p + c] = s.logprobs
    versions[row, p:p + c] = s.token_versions
  return SampleShard(tokens=tokens, valid=valid, loss_mask=loss_mask, sampler_logprobs=logprobs,
                     rewards=np.asarray(rewards, np.float32), prompt_ids=[s.group_id for s in samples],
                     group_ids=[s.group_id for s in samples], sample_indices=[s.sample_index for s in samples],
                     steps=[step] * n, first_versions=[s.first_version for s in samples],
                     last_versions=[s.last_version for s in samples], token_versions=versions)


class GroupCollector:
  """Holds samples until their group is complete, scores them, and returns the group's shard."""

  def __init__(self, group_size: int, tokenizer, reward_fn, width: int):
    self.group_size, self.tokenizer, self.reward_fn, self.width = group_size, tokenizer, reward_fn, width
    self._prompts: dict[int, tuple[str, int]] = {}
    self._pending: dict[int, list[Sample]] = {}

  def expect(self, group_id: int, prompt_text: str, step: int) -> None:
    self._prompts[group_id] = (prompt_text, step)
    self._pending[group_id] = []

  def add(self, sample: Sample) -> SampleShard | None:
    if sample.group_id not in self._pending:
      raise KeyError(f"sample of unknown group {sample.group_id}")
    group = self._pending[sample.group_id]
    group.append(sample)
    if len(group) < self.group_size:
      return None
    del self._pending[sample.group_id]
    prompt, step = self._prompts.pop(sample.group_id)
    group.sort(key=lambda s: s.sample_index)
    rewards = [self.reward_fn(prompt, self.tokenizer.decode(s.completion_tokens)) + s.env_reward for s in group]
    return samples_to_shard(group, rewards, self.width, step)

  def held(self) -> list[Sample]:
    """The finished samples of groups not yet whole."""
    return [sample for group in self._pending.values() for sample in group]

  @property
  def incomplete_groups(self) -> int:
    return len(self._pending)
