"""A reward that is a model (`Judge`): each sample (prompt and completion), a judge question after it, scored by a
second model on a pool of its own or the trainer's mesh; the reward is the judge's probability of 'yes' against
'no' after the question, batched a shard at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from streamrl_jax import launch
from streamrl_jax.models import load_hf
from streamrl_jax.models.catalog import resolve_model
from streamrl_jax.models.sharding import DEFAULT_RULES, state_shardings
from streamrl_jax.training.host_batch import placed_rows, read_rows


class Judge:
  """The judge model (`graphdef`, `params`) on `mesh`; `question`: the token ids put after each sample, `answers`:
  the token ids of 'yes' and 'no'. Calls pad to power-of-two buckets of `min_shape`: with its width the run's longest
  sample and the question, one program per row bucket (a group's rows: one)."""

  def __init__(self, graphdef, params, mesh, question: list[int], answers: tuple[int, int],
               min_shape: tuple[int, int] = (8, 16)):
    self.graphdef, self.mesh, self.question, self.answers, self.min_shape = graphdef, mesh, question, answers, min_shape
    self.params = launch.put(params, state_shardings(params, mesh, DEFAULT_RULES))
    self._score = launch.launcher(mesh).jit(self._impl, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def _impl(self, params, batch):
    model = nnx.merge(self.graphdef, params)
    hidden = model.hidden_states(batch["tokens"], batch["valid"])
    last = jnp.maximum(jnp.sum(batch["valid"], axis=1, dtype=jnp.int32) - 1, 0)
    at = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = model.head_logits(at).astype(jnp.float32)
    pair = logits[:, jnp.asarray(self.answers)]
    return jax.nn.softmax(pair, axis=-1)[:, 0]

  def __call__(self, tokens: np.ndarray, valid: np.ndarray, owners: np.ndarray | None = None) -> np.ndarray:
    """[rows] the judge's p(yes) / (p(yes) + p(no)) for each sample: its valid tokens, then the question; `owners`:
    each row judged on its owner's devices (a trainer of several processes), the verdicts then on every process."""
    rows = len(tokens)
    lengths = np.asarray(valid).sum(axis=1)
    width = int(lengths.max(initial=0)) + len(self.question)
    asked = np.zeros((rows, width), np.int32)
    mask = np.zeros(asked.shape, bool)
    for row in range(rows):
      sample = np.concatenate([np.asarray(tokens[row])[np.asarray(valid[row])], self.question])
      asked[row, :len(sample)], mask[row, :len(sample)] = sample, True
    placed, where = placed_rows(dict(tokens=asked, valid=mask), owners, self.mesh, self.min_shape)
    return read_rows(self._score(self.params, placed), where)


def load_judge(spec: str, question: str, student, mesh) -> Judge:
  """The judge model at `spec` on `mesh`, its question and answers encoded with the policy's tokenizer (`student`:
  its vocabulary size, compute dtype, tokenizer and longest sample; the judge reads the policy's tokens, so it needs
  the same vocabulary: refused by name otherwise)."""
  vocab_size, tokenizer = student.vocab_size, student.tokenizer
  model = load_hf(resolve_model(spec), compute_dtype=student.compute_dtype, mesh=mesh, rules=DEFAULT_RULES)
  if model.config.vocab_size != vocab_size:
    raise ValueError(f"WorkflowConfig.judge={spec!r} has a vocabulary of {model.config.vocab_size} tokens, the "
                     f"policy {vocab_size}: a judge reads the policy's tokens, so it needs the same tokenizer")
  graphdef, params = nnx.split(model)
  asked = list(tokenizer.encode(question))
  return Judge(graphdef, params, mesh, asked, answer_tokens(tokenizer), (8, student.longest + len(asked)))


def answer_tokens(tokenizer) -> tuple[int, int]:
  """The first tokens of ' yes' and ' no' (else of 'yes' and 'no', where a space is a token of its own)."""
  for space in (" ", ""):
    yes, no = (tokenizer.encode(space + word)[0] for word in ("yes", "no"))
    if yes != no:
      return yes, no
  raise ValueError("WorkflowConfig.judge: 'yes' and 'no' begin with the same token in this tokenizer")
