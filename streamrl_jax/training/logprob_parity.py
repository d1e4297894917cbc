"""The sampler's log-probabilities against the trainer's, at equal weights: what is left of the mismatch when
staleness is not in it (the compute part of `logprob_mismatch_kl`).

The trainer scores each sample's completion by its own code path (`CallLoss.token_logprobs`: the forward over the
whole sequence, float32 logits over vocabulary chunks, their log-softmax) three ways: the sample alone in a call of
its own length, padded (every sample right-padded into one call), and packed end to end with the others in rows
with segment ids. A sequence's log-probabilities must not depend on what else is in its call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.training.call_loss import CallLoss
from streamrl_jax.training.config import TrainerConfig
from streamrl_jax.training.logprobs import Truncation
from streamrl_jax.training.objectives import ObjectiveConfig
from streamrl_jax.training.packing import pack_rows

LAYOUTS = ("alone", "padded", "packed")


def _rows(samples: list, width: int) -> dict:
  """tokens (prompt + completion), valid, loss_mask and the sampler's logprobs of `samples` (each with
  prompt_tokens, completion_tokens, logprobs), right-padded to `width`."""
  out = {k: np.zeros((len(samples), width), d) for k, d in (("tokens", np.int32), ("valid", bool),
                                                              ("loss_mask", bool), ("logprobs", np.float32))}
  for row, s in enumerate(samples):
    p, c = len(s.prompt_tokens), len(s.completion_tokens)
    out["tokens"][row, :p + c] = list(s.prompt_tokens) + list(s.completion_tokens)
    out["valid"][row, :p + c], out["loss_mask"][row, p:p + c] = True, True
    out["logprobs"][row, p:p + c] = s.logprobs
  return out


def trainer_logprobs(graphdef, params, batch: dict, temperature: float, config: TrainerConfig = TrainerConfig(),
                     truncation: Truncation = Truncation()):
  """log pi [rows, length] of `batch`'s tokens as a trainer call computes them (over `truncation`'s support)."""
  given = {k: jnp.asarray(v) for k, v in batch.items() if k in ("tokens", "valid", "segment_ids")}
  return np.asarray(_scorer(graphdef, float(temperature), config, truncation)(params, given))


@functools.lru_cache(maxsize=8)
def _scorer(graphdef, temperature: float, config: TrainerConfig, truncation: Truncation):
  loss = CallLoss(ObjectiveConfig(), config, temperature, truncation=truncation)
  return jax.jit(lambda params, batch: loss.token_logprobs(nnx.merge(graphdef, params), batch)[0])


def max_abs_gaps(graphdef, params, samples: list, temperature: float, config: TrainerConfig = TrainerConfig(),
                 truncation: Truncation = Truncation()) -> dict[str, float]:
  """{layout: the largest |trainer - sampler| log-probability over every completion token} for `LAYOUTS`, the
  samples drawn with `truncation`'s top-k and top-p."""
  length = lambda s: len(s.prompt_tokens) + len(s.completion_tokens)  # noqa: E731
  longest = max(length(s) for s in samples)
  score = lambda batch: trainer_logprobs(graphdef, params, batch, temperature, config, truncation)  # noqa: E731
  gaps = {"alone": max(_gap(score(b), b) for b in (_rows([s], length(s)) for s in samples))}
  padded = _rows(samples, -(-longest // 16) * 16 + 16)  # a bucket past the longest: every row has padding
  gaps["padded"] = _gap(score(padded), padded)
  packed = pack_rows(padded, 2 * longest)
  gaps["packed"] = _gap(score(packed), packed)
  return gaps


def _gap(trainer: np.ndarray, batch: dict) -> float:
  mask = batch["loss_mask"]
  return float(np.abs(trainer - batch["logprobs"])[mask].max(initial=0.0))
