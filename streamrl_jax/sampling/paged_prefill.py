"""What a paged engine's prefill call carries from `prefill` to `insert`: the plan of its requests, the first
tokens `insert` gives them, and the host-made arrays the jitted insert takes."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from streamrl_jax.sampling.engine_base import RequestArrays


@flax.struct.dataclass
class FirstTokens:
  """Each request's first token from an insert call (the driver reads them at its next sync)."""

  first_token: jax.Array  # [R]
  first_logprob: jax.Array
  done: jax.Array
  routes: jax.Array | None = None  # a mixture: [R, bucket, sparse layers, k] experts its prompt's tokens took (-1:
  # not computed in this call, a prompt the prefix cache held)


@dataclasses.dataclass
class PagedPrefix:
  """A prefill call's plan (`prefill` only checks and lays out; `insert` prefills what the prefix cache does
  not hold): per request its prompt, sampling arrays and resume state; after `insert`, its first tokens."""

  prompts: list[np.ndarray]
  keys: list  # (prompt tokens, version) of each request; None: not shared (resumed, or sharing off)
  resume: list  # (last token, generated) or None
  arrays: RequestArrays  # key data, sampling knobs and resume state over the padded request rows
  bucket: int  # length bucket of the longest prompt
  params: object = None  # the weights the prompts are prefilled with
  firsts: FirstTokens | None = None

  @property
  def first_token(self):
    return self.firsts.first_token

  @property
  def first_logprob(self):
    return self.firsts.first_logprob

  @property
  def done(self):
    return self.firsts.done

  @property
  def routes(self):
    return self.firsts.routes

  @property
  def valid(self):  # the driver reads its width: the cache length a row's prompt may reach
    return np.zeros((1, self.bucket), bool)


class InsertPlan:
  """An insert call's host-made arrays: per request its slot, length, logits row and page ops; per fresh prompt
  the cache entry it fills and the copy of its partly filled page into that entry."""

  def __init__(self, rows: int, table_rows: int):
    self.table_rows = table_rows
    self.slots = np.full((rows,), 1 << 30, np.int32)  # out of range: a padding row writes nothing
    self.lengths = np.zeros((rows,), np.int32)
    self.logit_row = np.zeros((rows,), np.int32)
    self.writer = np.zeros((rows,), bool)
    self.write_row = np.zeros((rows,), np.int32)
    self.copy_from, self.copy_to = np.full((rows,), -1, np.int32), np.full((rows,), -1, np.int32)
    self.cache_copy_from, self.cache_copy_to = np.full((rows,), -1, np.int32), np.full((rows,), -1, np.int32)
    self.cache_entry = np.full((rows,), 1 << 30, np.int32)

  def arrays(self, table: np.ndarray) -> dict:
    """The plan as the jitted insert takes it; `table` rows of the requests' slots (the writers' pages)."""
    return dict(slots=self.slots, lengths=self.lengths, logit_row=self.logit_row, writer=self.writer,
                write_row=self.write_row, copy_from=self.copy_from, copy_to=self.copy_to,
                cache_copy_from=self.cache_copy_from, cache_copy_to=self.cache_copy_to, cache_entry=self.cache_entry,
                table=table[np.minimum(self.slots, self.table_rows - 1)])


def one_hot(size: int, index: int, value: int) -> np.ndarray:
  out = np.zeros((size,), np.int32)
  out[index] = value
  return out
