"""Sample shards and Arrow batches for the wire tests."""

import numpy as np
import pyarrow as pa
from streamrl_jax.streaming import SampleShard


VOCAB = 50


def group_shard(lengths, prompt_len=2, step=3, seed=0, group=7, functions=1) -> SampleShard:
  """One group (`group`) of `step`: a sample of each length, indices 0, 1, ...; scored by `functions` reward
  functions weighted 1, 0.5, 0.25, ..."""
  rng = np.random.default_rng(seed)
  n, width = len(lengths), max(lengths) + 3
  valid = np.arange(width)[None] < np.asarray(lengths)[:, None]
  loss_mask = valid & (np.arange(width)[None] >= prompt_len)
  versions = np.where(loss_mask, np.where(np.arange(width)[None] > prompt_len, 3, 2), 0)  # an update after token 1
  parts = rng.random((n, functions)).astype(np.float32)
  return SampleShard(tokens=rng.integers(0, VOCAB, (n, width)) * valid, valid=valid, loss_mask=loss_mask,
                     logprobs=-rng.random((n, width)) * valid, rewards=parts @ (0.5 ** np.arange(functions, dtype=np.float32)),
                     reward_parts=parts, reward_errors=rng.integers(0, 2, n), reward_timeouts=rng.integers(0, 2, n),
                     group_ids=np.full(n, group), sample_indices=np.arange(n),
                     steps=np.full(n, step), first_versions=np.full(n, 2),
                     last_versions=np.where(loss_mask.sum(1) > 1, 3, 2), versions=versions)


def _replace_column(batch: pa.RecordBatch, name: str, values) -> pa.RecordBatch:
  columns = [values if f.name == name else batch.column(i) for i, f in enumerate(batch.schema)]
  return pa.record_batch(columns, schema=batch.schema)
