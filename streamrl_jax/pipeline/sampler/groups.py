"""Turns finished, scored samples into `SampleShard`s, one per complete group (GRPO needs whole groups)."""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.rewards.scorer import Score
from streamrl_jax.streaming import SampleShard
from streamrl_jax.streaming.shard import ROUTES_DTYPE
from streamrl_jax.tasks.rows import Row
from streamrl_jax.types import Sample


def samples_to_shard(samples: list[Sample], scores: list[Score], width: int, step: int) -> SampleShard:
  """Prompt + completion right-padded to `width`; logprobs aligned with the tokens they score; `step` is
  the RL step the samples were generated for. A sample's reward is its score's total plus its environment's."""
  n = len(samples)
  tokens = np.zeros((n, width), np.int32)
  valid = np.zeros((n, width), bool)
  loss_mask = np.zeros((n, width), bool)
  logprobs = np.zeros((n, width), np.float32)
  versions = np.zeros((n, width), np.int64)
  routed = next((s.routes for s in samples if s.routes is not None), None)
  routes = None if routed is None else np.zeros((n, width) + routed.shape[1:], ROUTES_DTYPE)
  for row, s in enumerate(samples):
    p, c = len(s.prompt_tokens), len(s.completion_tokens)
    if p + c > width:
      raise ValueError(f"sample {s.request_id}: {p + c} tokens exceed the shard width {width}")
    tokens[row, :p], tokens[row, p:p + c] = s.prompt_tokens, s.completion_tokens
    valid[row, :p + c] = True
    loss_mask[row, p:p + c] = True if s.loss_mask is None else s.loss_mask  # an environment's tokens: False
    logprobs[row, p:p + c] = s.logprobs
    versions[row, p:p + c] = s.versions
    if routes is not None and s.routes is not None:
      routes[row, :p + c] = s.routes
  return SampleShard(tokens=tokens, valid=valid, loss_mask=loss_mask, logprobs=logprobs,
                     rewards=np.asarray([c.total + s.env_reward for c, s in zip(scores, samples)], np.float32),
                     group_ids=[s.group_id for s in samples], sample_indices=[s.sample_index for s in samples],
                     steps=[step] * n, first_versions=[s.first_version for s in samples],
                     last_versions=[s.last_version for s in samples], versions=versions,
                     reward_parts=np.asarray([c.parts for c in scores], np.float32).reshape(n, -1),
                     reward_errors=[c.errors for c in scores], reward_timeouts=[c.timeouts for c in scores],
                     routes=routes)


@dataclasses.dataclass
class _Group:
  prompt: str
  row: Row
  step: int
  samples: dict = dataclasses.field(default_factory=dict)  # sample index -> Sample
  scores: dict = dataclasses.field(default_factory=dict)  # sample index -> Score


class GroupCollector:
  """Holds a lease's samples until their group is complete and every sample scored, and returns the group's shard.
  Scoring is the caller's (`RewardScorer`, off the decode loop): `add` says what to score, `scored` takes it back."""

  def __init__(self, group_size: int, width: int):
    self.group_size, self.width = group_size, width
    self._groups: dict[int, _Group] = {}

  def expect(self, group_id: int, prompt_text: str, step: int, row: Row = Row()) -> None:
    self._groups[group_id] = _Group(prompt_text, row, step)

  def add(self, sample: Sample) -> _Group:
    """Holds a finished sample; returns its group (prompt and row), for scoring."""
    group = self._groups.get(sample.group_id)
    if group is None:
      raise KeyError(f"sample of unknown group {sample.group_id}")
    if sample.sample_index in group.samples:
      raise KeyError(f"sample {sample.sample_index} of group {sample.group_id} arrived twice")
    group.samples[sample.sample_index] = sample
    return group

  def scored(self, group_id: int, sample_index: int, score: Score) -> SampleShard | None:
    """A sample's score; the group's shard once the group is whole and scored."""
    group = self._groups[group_id]
    group.scores[sample_index] = score
    if len(group.scores) < self.group_size:
      return None
    del self._groups[group_id]
    order = sorted(group.samples)
    return samples_to_shard([group.samples[k] for k in order], [group.scores[k] for k in order], self.width,
                            group.step)

  def held(self) -> list[Sample]:
    """The finished samples of groups not out yet (incomplete, or not all scored)."""
    return [sample for group in self._groups.values() for sample in group.samples.values()]

  @property
  def incomplete_groups(self) -> int:
    return len(self._groups)
