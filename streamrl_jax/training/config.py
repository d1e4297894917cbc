"""The training part's configuration: the trainer's batching and memory (`TrainerConfig`) and the optimizer
(`OptimizerConfig`); the policy loss's (`ObjectiveConfig`) stays beside the objectives' registry it names."""

from __future__ import annotations

import dataclasses

from streamrl_jax.models.config import REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """`logprob_chunk`: vocabulary entries per chunk of the log-probabilities (`training.logprobs`); 0 builds the
  full [tokens, vocab] logits. `remat`: "none", "layer" or "dots" (`ModelConfig.remat`), the trainer's own.
  `activation_budget_mb`: the temporaries of one trainer call (its gradient before it joins the running sum, and
  its activations: `training.packing.call_bytes`); the packed tokens per call are cut to fit. 0: 40% of a
  device's memory; on the CPU, the gradient plus 1 GiB, or one packed row (`training.packing.auto_budget`).

  `packing`: samples are packed end to end into rows (segment ids), so compute follows tokens; `pack_length` is
  the packed rows' length (0: the longest sample, prompt + new tokens, rounded up to 8), and `chunk_tokens` the
  tokens (padding included) per trainer call (0: a step, a quarter of one in `stream` mode, within memory).
  Without packing, micro-batches of `chunk_rows` rows. `precompile`: every trainer call's shape is compiled
  before the first step (no stalls later)."""

  logprob_chunk: int = 8192
  remat: str = "none"
  activation_budget_mb: int = 0
  packing: bool = True
  pack_length: int = 0
  chunk_tokens: int = 0
  chunk_rows: int = 8
  precompile: bool = False

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"TrainerConfig.remat={self.remat!r}; known: {list(REMAT_POLICIES)}")
    for name in ("logprob_chunk", "activation_budget_mb", "pack_length", "chunk_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"TrainerConfig.{name} must be >= 0 (0: automatic), got {getattr(self, name)}")
    if self.chunk_rows < 1:
      raise ValueError(f"TrainerConfig.chunk_rows must be >= 1, got {self.chunk_rows}")


SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping and a warm-up then decay schedule."""

  learning_rate: float = 1e-5
  schedule: str = "constant"
  warmup_steps: int = 0
  decay_steps: int = 1000  # for cosine/linear: steps from the end of warm-up to the end value
  end_lr_fraction: float = 0.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0  # 0: no clipping

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"unknown schedule {self.schedule!r}; known: {list(SCHEDULES)}")
    if self.learning_rate <= 0 or self.warmup_steps < 0 or self.decay_steps < 1 or self.max_grad_norm < 0:
      raise ValueError(f"OptimizerConfig out of range: {self}")
