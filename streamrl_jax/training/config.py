"""The training part's configuration: the optimizer (`OptimizerConfig`) and the trainer side of a run
(`TrainerConfig`: batching and memory, its queue and stop limits, and its optimizer, policy loss and adapters); the
policy loss's own (`ObjectiveConfig`) stays beside the objectives' registry it names."""

from __future__ import annotations

import dataclasses

from streamrl_jax.models.config import REMAT_POLICIES
from streamrl_jax.models.fused_attention import ATTENTION
from streamrl_jax.models.lora import LoraConfig
from streamrl_jax.training.objectives import ObjectiveConfig

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping and a warm-up then decay schedule."""

  learning_rate: float = 1e-5  # peak learning rate, reached at the end of warm-up
  schedule: str = "constant"  # after warm-up: "constant", "cosine" or "linear" decay
  warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to learning_rate (0: none)
  decay_steps: int = 1000  # for cosine/linear: steps from the end of warm-up to the end value
  end_lr_fraction: float = 0.0  # cosine/linear: the final learning rate as a fraction of learning_rate
  weight_decay: float = 0.0  # AdamW's decoupled weight decay (0: none)
  b1: float = 0.9  # Adam's first-moment decay
  b2: float = 0.999  # Adam's second-moment decay
  eps: float = 1e-8  # Adam's denominator epsilon
  max_grad_norm: float = 1.0  # clip gradients to this global norm; 0: no clipping

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"unknown schedule {self.schedule!r}; known: {list(SCHEDULES)}")
    if self.learning_rate <= 0 or self.warmup_steps < 0 or self.decay_steps < 1 or self.max_grad_norm < 0:
      raise ValueError(f"OptimizerConfig out of range: {self}")


@dataclasses.dataclass(frozen=True)
class WaitConfig:
  """How many samples wait for the trainer, and when it stops waiting."""

  queue_capacity: int = 256  # samples in the host queue before the sampler blocks
  # after a stop request (first Ctrl-C / SIGTERM) the step in progress finishes and checkpoints, unless it is
  # still waiting for samples this many seconds later: then it is abandoned (resume: the checkpoint before)
  stop_grace_s: float = 120.0
  # seconds without progress (no shard, update, publication or checkpoint) after which the trainer exits
  # with code 124 and a one-line reason instead of hanging; 0: no limit
  step_timeout_s: float = 1800.0

  def __post_init__(self):
    if self.queue_capacity < 1:
      raise ValueError(f"WaitConfig.queue_capacity must be >= 1, got {self.queue_capacity}")
    if not self.stop_grace_s > 0:
      raise ValueError(f"WaitConfig.stop_grace_s must be > 0 seconds, got {self.stop_grace_s}")
    if self.step_timeout_s < 0:
      raise ValueError(f"WaitConfig.step_timeout_s must be >= 0 seconds (0: no limit), got {self.step_timeout_s}")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """A run's trainer side: how samples become trainer calls and what each call may hold, how many samples wait
  for it, when it gives up, and what it optimizes (optimizer, policy loss, adapters).

  With `packing`, samples are packed end to end into rows (segment ids), so compute follows tokens; without it,
  each call is a micro-batch of `chunk_rows` padded rows."""

  # vocabulary entries per chunk of the log-probabilities (`training.logprobs`); 0: full [tokens, vocab] logits
  logprob_chunk: int = 8192
  remat: str = "none"  # the trainer's rematerialisation: "none", "layer" or "dots" (see ModelConfig.remat)
  # the trainer's attention: "auto" (Pallas splash attention on a TPU, XLA's elsewhere), "xla", or "splash" (the
  # kernel on every backend: off a TPU in Pallas' interpret mode, slow; for tests)
  attention: str = "auto"
  # MiB for one trainer call's gradient and activations (tokens per call are cut to fit); 0: 40% of
  # device memory, on CPU the gradient plus 1 GiB or one packed row (`packing.auto_budget`)
  activation_budget_mb: int = 0
  packing: bool = True  # pack samples end to end into rows of pack_length; False: chunk_rows padded rows per call
  pack_length: int = 0  # tokens per packed row; 0: the longest sample (prompt + new tokens) rounded up to 8
  # tokens per packed trainer call, padding included, within the budget; 0: a step (stream mode: a quarter)
  chunk_tokens: int = 0
  chunk_rows: int = 8  # without packing: samples per trainer call (micro-batch)
  precompile: bool = False  # compile every trainer call's shape before the first step (no stalls later)
  wait: WaitConfig = WaitConfig()  # how many samples wait for the trainer, and how long it waits
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
  objective: ObjectiveConfig = ObjectiveConfig()
  lora: LoraConfig = LoraConfig()  # low-rank adapters: rank 0 trains every weight
  # a step's samples in this many mini-batches of whole groups, one optimizer update each (verl's ppo_mini_batch_size,
  # AReaL's ppo_n_minibatches, as a count); 1: one update a step
  mini_batches: int = 1
  epochs: int = 1  # passes over a step's samples (TRL's num_iterations, verl's ppo_epochs): mini_batches x epochs updates

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"TrainerConfig.remat={self.remat!r}; known: {list(REMAT_POLICIES)}")
    if self.attention not in ATTENTION:
      raise ValueError(f"TrainerConfig.attention={self.attention!r}; known: {list(ATTENTION)}")
    for name in ("logprob_chunk", "activation_budget_mb", "pack_length", "chunk_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"TrainerConfig.{name} must be >= 0 (0: automatic), got {getattr(self, name)}")
    for name in ("chunk_rows", "mini_batches", "epochs"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")

  @property
  def updates(self) -> int:
    """Optimizer updates a step: `mini_batches` x `epochs`."""
    return self.mini_batches * self.epochs
