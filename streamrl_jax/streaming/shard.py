"""`SampleShard`: finished samples as numpy arrays plus the policy versions that produced them.

`encode_shard` / `decode_shard` turn a shard into bytes and back without pickle (a JSON header followed
by the raw array buffers), so a network transport can carry the same type.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

ROW_FIELDS = {"rewards": np.float32, "prompt_ids": np.int64, "group_ids": np.int64, "first_versions": np.int64,
              "last_versions": np.int64}
TOKEN_FIELDS = {"tokens": np.int32, "valid": np.bool_, "loss_mask": np.bool_, "sampler_logprobs": np.float32}


@dataclasses.dataclass(frozen=True)
class SampleShard:
  """n finished samples, right-padded to a common length L.

  tokens [n, L] hold prompt then completion; `valid` marks real tokens, `loss_mask` completion tokens;
  sampler_logprobs [n, L] is the sampler's log-probability of each completion token (0 elsewhere).
  """

  tokens: np.ndarray
  valid: np.ndarray
  loss_mask: np.ndarray
  sampler_logprobs: np.ndarray
  rewards: np.ndarray
  prompt_ids: np.ndarray
  group_ids: np.ndarray
  first_versions: np.ndarray
  last_versions: np.ndarray

  def __post_init__(self):
    n, length = np.shape(self.tokens)
    for name, dtype in {**TOKEN_FIELDS, **ROW_FIELDS}.items():
      value = np.asarray(getattr(self, name), dtype)
      expected = (n, length) if name in TOKEN_FIELDS else (n,)
      if value.shape != expected:
        raise ValueError(f"SampleShard.{name} has shape {value.shape}, expected {expected}")
      object.__setattr__(self, name, value)
    if np.any(self.loss_mask & ~self.valid):
      raise ValueError("SampleShard.loss_mask marks tokens that are not valid")

  @property
  def num_samples(self) -> int:
    return len(self.tokens)

  @property
  def min_version(self) -> int:
    return int(self.first_versions.min()) if len(self.first_versions) else 0

  @classmethod
  def concat(cls, shards: list[SampleShard]) -> SampleShard:
    width = max(s.tokens.shape[1] for s in shards)
    pad = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])))  # noqa: E731
    fields = {k: np.concatenate([pad(getattr(s, k)) for s in shards]) for k in TOKEN_FIELDS}
    fields.update({k: np.concatenate([getattr(s, k) for s in shards]) for k in ROW_FIELDS})
    return cls(**fields)

  def train_batch(self, advantages: np.ndarray) -> dict:
    """The micro-batch dict the trainer takes, with one advantage per sample."""
    return dict(tokens=self.tokens, valid=self.valid, loss_mask=self.loss_mask, sampler_logprobs=self.sampler_logprobs,
                advantages=np.asarray(advantages, np.float32))


def encode_shard(shard: SampleShard) -> bytes:
  names = list(TOKEN_FIELDS) + list(ROW_FIELDS)
  arrays = [np.ascontiguousarray(getattr(shard, k)) for k in names]
  header = json.dumps({"fields": [[k, a.dtype.str, list(a.shape), a.nbytes] for k, a in zip(names, arrays)]})
  head = header.encode()
  return len(head).to_bytes(8, "little") + head + b"".join(a.tobytes() for a in arrays)


def decode_shard(data: bytes) -> SampleShard:
  size = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + size])
  offset, fields = 8 + size, {}
  for name, dtype, shape, nbytes in header["fields"]:
    fields[name] = np.frombuffer(data, np.dtype(dtype), count=int(np.prod(shape)), offset=offset).reshape(shape)
    offset += nbytes
  if offset != len(data):
    raise ValueError(f"shard bytes: {len(data) - offset} bytes left over after the declared arrays")
  return SampleShard(**fields)
