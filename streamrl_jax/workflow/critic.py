"""PPO's critic as stages of the step graph (`Critic`): a value model on the trainer's mesh or a pool of its own, its
trunk starting as the policy's and its head at zero, that scores each shard's tokens (`critic_values`) and learns their
returns (`critic_update`); its optimizer steps with the policy's, once a step, and its state is checkpointed with the
policy's.

Values are aligned with the sampler's log-probabilities: column t holds V of the state before token t (the value
model's output at t - 1; column 0 is 0), the baseline of the action that wrote token t."""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from streamrl_jax.models import ModelConfig, ValueModel
from streamrl_jax.training import Buckets, Trainer, TrainerConfig
from streamrl_jax.training.objectives import ValueLossConfig
from streamrl_jax.training.host_batch import placed_rows, read_rows

CRITIC_METRICS = ("loss", "grad_norm", "clip_frac")  # of its update, in a step's row as critic/<name>


def earlier(x: np.ndarray) -> np.ndarray:
  """`x` one column to the left (its last column zero): what the value model's output at t - 1 is trained on."""
  out = np.zeros_like(x)
  out[:, :-1] = x[:, 1:]
  return out


class Critic:
  """A value model's training state on its `trainer`'s mesh (`Trainer(role="critic")`, calls `width` tokens wide:
  one program per row bucket), fed shard by shard, stepped by `end_step`."""

  def __init__(self, trainer: Trainer, params, seed: int = 0, chunk_rows: int = 8):
    self.trainer, self.chunk_rows = trainer, chunk_rows
    self.state = trainer.init_state(params, seed=seed)
    self._values = trainer.launcher.jit(lambda params, batch: nnx.merge(trainer.graphdef, params)(
        batch["tokens"], batch["valid"]), out_shardings=NamedSharding(trainer.mesh, PartitionSpec()))

  def __call__(self, tokens: np.ndarray, valid: np.ndarray, owners: np.ndarray | None = None) -> np.ndarray:
    """[rows, length] values under the current weights, column t the state's before token t (column 0 is 0);
    `owners`: each row valued on its owner's devices (a trainer of several processes), the values on every process."""
    rows, length = np.shape(tokens)
    trainer = self.trainer
    batch, where = placed_rows(dict(tokens=tokens, valid=valid), owners, trainer.mesh,
                               (trainer.min_rows, trainer.min_length), trainer.rules)
    out = read_rows(self._values(self.state.params, batch), where)[:, :length]
    values = np.zeros((rows, length), np.float32)
    values[:, 1:] = out[:, :-1]
    return values

  def accumulate(self, tokens, valid, loss_mask, values, returns, owners: np.ndarray | None = None) -> None:
    """Adds the clipped value loss (`ValueLossConfig`: `WorkflowConfig.value_loss`) of the loss tokens' `returns` to
    the step's gradient, `values` the old values it clips around; `owners`: each row on its owner's devices (a
    trainer of several processes, each its own rows' tokens)."""
    batch = dict(tokens=np.asarray(tokens), valid=np.asarray(valid, bool),
                 loss_mask=earlier(np.asarray(loss_mask, bool)), returns=earlier(np.asarray(returns, np.float32)),
                 old_values=earlier(np.asarray(values, np.float32)))
    if owners is not None:
      batch["owners"] = np.repeat(np.asarray(owners)[:, None], batch["tokens"].shape[1], axis=1)
    for start in range(0, len(batch["tokens"]), self.chunk_rows):
      part = {k: v[start:start + self.chunk_rows] for k, v in batch.items()}
      self.state = self.trainer.accumulate(self.state, part)

  def end_step(self) -> dict[str, float]:
    """The optimizer step on what the step added (none when it added no loss token); its `CRITIC_METRICS` as the
    row's keys."""
    if float(self.state.sums["tokens"]) == 0:
      return {}
    self.state, metrics = self.trainer.apply(self.state)
    return {f"critic/{name}": metrics[name] for name in CRITIC_METRICS}


def make_critic(model_config: ModelConfig, policy_params, config: TrainerConfig, mesh, width: int,
                seed: int = 0, value_loss: ValueLossConfig = ValueLossConfig()) -> Critic:
  """A `Critic` on `mesh` whose trunk is a copy of `policy_params` (a model of `model_config`), trained with the
  policy's optimizer and `value_loss`, scoring calls `width` tokens wide (the run's longest sample)."""
  graphdef, params = nnx.split(ValueModel(model_config, rngs=nnx.Rngs(seed)))
  params["trunk"] = policy_params
  trainer = Trainer(graphdef, config.optimizer, config.objective, mesh, role="critic", config=config,
                    buckets=Buckets(min_length=width))
  trainer.loss = dataclasses.replace(trainer.loss, value_loss=value_loss)
  return Critic(trainer, params, seed=seed, chunk_rows=config.chunk_rows)
