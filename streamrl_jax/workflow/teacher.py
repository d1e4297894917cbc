"""A frozen model that scores tokens on a pool of its own or the trainer's mesh (`FrozenScorer`): a distill graph's
teacher, read from a catalog name, GGUF, Hugging Face directory or Hub id (`load_teacher`)."""

from __future__ import annotations

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from streamrl_jax import launch
from streamrl_jax.models import load_hf
from streamrl_jax.models.catalog import resolve_model
from streamrl_jax.models.sharding import DEFAULT_RULES, state_shardings
from streamrl_jax.training.call_loss import CallLoss
from streamrl_jax.training.host_batch import placed_rows, read_rows


class FrozenScorer:
  """log p of each token under the model (`graphdef`, `params`) on `mesh`, scored as `loss` scores the policy's (the
  sampler's temperature and truncation, vocabulary chunks); calls pad to power-of-two buckets of `min_shape`: with
  its width the run's longest sample, one program per row bucket (a group's rows: one)."""

  def __init__(self, graphdef, params, mesh, loss: CallLoss, min_shape: tuple[int, int] = (8, 16)):
    self.graphdef, self.mesh, self.loss, self.min_shape = graphdef, mesh, loss, min_shape
    self.launcher = launch.launcher(mesh)
    self.params = launch.put(params, state_shardings(params, mesh, DEFAULT_RULES))
    self._score = self.launcher.jit(self._impl, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def _impl(self, params, batch):
    return self.loss.token_logprobs(nnx.merge(self.graphdef, params), batch, replay=False)[0]

  def __call__(self, tokens: np.ndarray, valid: np.ndarray, owners: np.ndarray | None = None) -> np.ndarray:
    """[rows, length] log-probabilities (column 0 is 0); `owners`: each row scored on its owner's devices (a trainer
    of several processes), the scores then on every process."""
    placed, where = placed_rows(dict(tokens=tokens, valid=valid), owners, self.mesh, self.min_shape)
    return read_rows(self._score(self.params, placed), where)[:, :np.shape(tokens)[1]]


def load_teacher(spec: str, vocab_size: int, compute_dtype: str, mesh, loss: CallLoss, width: int) -> FrozenScorer:
  """The teacher model at `spec` scoring on `mesh` calls `width` tokens wide (the run's longest sample); refused by
  name when its vocabulary is not the policy's."""
  model = load_hf(resolve_model(spec), compute_dtype=compute_dtype, mesh=mesh, rules=DEFAULT_RULES)  # onto its pool
  if model.config.vocab_size != vocab_size:
    raise ValueError(f"WorkflowConfig.teacher={spec!r} has a vocabulary of {model.config.vocab_size} tokens, the "
                     f"policy {vocab_size}: a teacher scores the policy's tokens, so it needs the same tokenizer")
  graphdef, params = nnx.split(model)
  return FrozenScorer(graphdef, params, mesh, loss, (8, width))
