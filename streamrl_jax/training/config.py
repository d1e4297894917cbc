"""How the trainer spends memory: log-probabilities over vocabulary chunks, rematerialisation, and the
activation budget a trainer call is cut to."""

from __future__ import annotations

import dataclasses

from streamrl_jax.models.config import REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """`logprob_chunk`: vocabulary entries per chunk of the log-probabilities (`training.logprobs`); 0 builds the
  full [tokens, vocab] logits. `remat`: "none", "layer" or "dots" (`ModelConfig.remat`), the trainer's own.
  `activation_budget_mb`: the temporaries of one trainer call (its gradient before it joins the running sum, and
  its activations: `training.packing.call_bytes`); the packed tokens per call are cut to fit. 0: 40% of a
  device's memory; on the CPU, the gradient plus 1 GiB, or one packed row (`training.packing.auto_budget`)."""

  logprob_chunk: int = 8192
  remat: str = "none"
  activation_budget_mb: int = 0

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"TrainerConfig.remat={self.remat!r}; known: {list(REMAT_POLICIES)}")
    for name in ("logprob_chunk", "activation_budget_mb"):
      if getattr(self, name) < 0:
        raise ValueError(f"TrainerConfig.{name} must be >= 0, got {getattr(self, name)}")
