"""What the sampler's scheduling is told by a run: the policy by name, the instance counts and the latency
curve its dispatch plans with."""

from __future__ import annotations

import dataclasses

from streamrl_jax.scheduling.policies import elastic_target, ptl_at
from streamrl_jax.scheduling.registry import SCHEDULING_POLICIES, SchedulingPolicy

# Seconds per decode step by batch size, measured on the 2-core CPU this project is developed on with
# the ~10M-parameter benchmark model (`python benchmarks/sampler.py`, ptl_ms_by_batch). Set your own
# model's, from `streamrl_jax.sampling.measure_ptl_curve`.
CPU_PTL_CURVE = ((1, 0.0053), (2, 0.0056), (4, 0.0067), (8, 0.0083), (16, 0.0110), (32, 0.0178))


@dataclasses.dataclass(frozen=True)
class RankerConfig:
  """Size and training of the output-length ranker that orders prompts for the skew_aware policy."""

  vocab_buckets: int = 1024  # embedding rows; token ids are hashed into them (id mod vocab_buckets)
  max_prompt_length: int = 64  # longer prompts keep their last tokens
  embed_dim: int = 32  # width of the token and position embeddings and the attention layer
  hidden_dim: int = 64  # width of the token MLP and of the scoring head
  learning_rate: float = 3e-3  # AdamW learning rate of the ranker's training
  batch_size: int = 64  # (prompt, length) pairs per training batch, drawn from the history; >= 2
  history: int = 2048  # most recent (prompt, length) pairs kept to train on
  steps_per_round: int = 16  # optimizer steps per background round (one round per new observation batch)
  seed: int = 0  # seeds the ranker's initial weights and its batch draws

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if field.name != "seed" and getattr(self, field.name) <= 0:
        raise ValueError(f"RankerConfig.{field.name} must be > 0, got {getattr(self, field.name)}")
    if self.batch_size < 2:
      raise ValueError(f"RankerConfig.batch_size must be >= 2 to form pairs, got {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class SchedulingConfig:
  """How the sampler dispatches and admits requests, and whether it grows or shrinks."""

  # "fifo": random dispatch, arrival-order admission, full batches; "skew_aware": the ranker's predicted-longest
  # `alpha` share goes to long-tail instances sized by ptl_curve, admission longest-first
  policy: str = "fifo"
  instances: int = 1  # engine instances at start
  max_instances: int = 0  # the sampler mesh is cut into this many equal sub-meshes; 0: as many as `instances`
  min_instances: int = 1  # elastic: the fewest instances it shrinks to
  # add or remove an instance between steps when generation and training times diverge (`elastic_target`)
  elastic: bool = False
  alpha: float = 0.2  # skew_aware: the predicted-longest share of the requests that forms the long tail; in (0, 1)
  hysteresis: float = 0.05  # elastic: fraction of the step time a change must clear (no oscillation)
  # run each instance on an engine compiled for its planned batch (a power of two; a compile per new size), not
  # the full-size engine with slots capped: a decode step costs its compiled slots, busy or not
  resize_engines: bool = True
  # skew_aware's latency model: (batch size, seconds per decode step) points; the default: a 2-core CPU's
  ptl_curve: tuple[tuple[int, float], ...] = CPU_PTL_CURVE
  ranker: RankerConfig = RankerConfig()

  def __post_init__(self):
    if self.policy not in SCHEDULING_POLICIES.names():
      raise ValueError(f"SchedulingConfig.policy={self.policy!r}; known: {SCHEDULING_POLICIES.names()}")
    if not 0 < self.alpha < 1:
      raise ValueError(f"SchedulingConfig.alpha must be in (0, 1), got {self.alpha}")
    if not self.ptl_curve:
      raise ValueError("SchedulingConfig.ptl_curve is empty: the latency model needs (batch, seconds) points")
    ptl_at(self.curve, 1)  # validates the points
    if not 1 <= self.min_instances <= self.instances <= self.instance_limit:
      raise ValueError(f"need 1 <= min_instances ({self.min_instances}) <= instances ({self.instances}) <= "
                       f"max_instances ({self.instance_limit})")
    if self.hysteresis < 0:
      raise ValueError(f"SchedulingConfig.hysteresis must be >= 0, got {self.hysteresis}")

  @property
  def instance_limit(self) -> int:
    """Sub-meshes the sampler mesh is cut into: the most instances that can run."""
    return self.max_instances or self.instances

  @property
  def scheduling_policy(self) -> SchedulingPolicy:
    """The registered policy `policy` names: its dispatch, admission order and whether it needs the ranker."""
    return SCHEDULING_POLICIES.get(self.policy)

  def instance_target(self, current: int, gen_s: float, train_s: float) -> int:
    """The instance count for the next step: `current` unless `elastic`, else the elastic rule
    (`policies.elastic_target`) between `min_instances` and `instance_limit`."""
    if not self.elastic:
      return current
    return elastic_target(current, gen_s, train_s, low=self.min_instances, high=self.instance_limit,
                          hysteresis=self.hysteresis)

  @property
  def curve(self) -> dict[int, float]:
    return {int(b): float(s) for b, s in self.ptl_curve}
