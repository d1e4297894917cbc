"""Several optimizer updates a step (`TrainerConfig.mini_batches` x `TrainerConfig.epochs`).

A step's groups are cut into mini-batches of whole groups in the order they arrive (a group's advantages are never
cut); the first pass updates once a mini-batch's groups are all in, so in `stream` and `async` mode training goes on
while the rest of the step is sampled; later passes go over the step's kept batches once the step is whole.

"Old" log-probabilities, the denominator of the surrogate's ratio, are those of the weights at the step's start (as
verl and TRL define them): a batch trained at those weights (the first mini-batch of the first pass) takes them from
its own forward pass, free; every other batch gets them once, from a copy of the step's starting weights, and keeps
them for its later passes. With `ObjectiveConfig.old_logprobs='sampler'` they are the sampler's, and no copy is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from streamrl_jax import launch
from streamrl_jax.phase_clock import PhaseClock
from streamrl_jax.training import MicroBatcher, Trainer, TrainerConfig


def check_updates(config: TrainerConfig, processes: int, learners) -> None:
  """Refuses several updates a step where they are not built: a trainer of several processes, a step graph with a
  learning stage (the ppo graph's critic steps once a step)."""
  if config.updates == 1:
    return
  asked = f"TrainerConfig.mini_batches={config.mini_batches}, epochs={config.epochs}"
  if processes > 1:
    raise ValueError(f"{asked}: several updates a step are built for a trainer of one process; this one has "
                     f"{processes} (set mini_batches=1 and epochs=1)")
  if learners:
    raise ValueError(f"{asked}: the step graph's learning stages ({', '.join(sorted(learners))}) update once a step; "
                     "several policy updates beside them are not built (set mini_batches=1 and epochs=1)")


def mini_batch_bounds(groups: int, mini_batches: int) -> tuple[int, ...]:
  """The groups trained once each mini-batch is complete (cumulative): `groups` split as evenly as possible, the earlier
  mini-batches the larger."""
  if not 1 <= mini_batches <= groups:
    raise ValueError(f"TrainerConfig.mini_batches={mini_batches}: a step of {groups} groups (prompts_per_step) splits "
                     f"into 1 to {groups} mini-batches of whole groups")
  base, extra = divmod(groups, mini_batches)
  return tuple(int(x) for x in np.cumsum([base + (i < extra) for i in range(mini_batches)]))


def split_at_group(groups: np.ndarray, seen: set, room: int) -> int:
  """Rows (in order) whose groups fit the current mini-batch: a row of a group already in it, or of a new group while
  `room` new groups are left. The rows of one group are taken together; returns the first row that does not fit."""
  taken = set()
  for row, group in enumerate(groups.tolist()):
    if group not in seen and group not in taken:
      if len(taken) == room:
        return row
      taken.add(group)
  return len(groups)


@dataclasses.dataclass
class UpdateRecord:
  """What a step's updates did: each update's metrics, the seconds waited before the first (the last step's save)."""

  metrics: list = dataclasses.field(default_factory=list)
  waited_s: float = 0.0

  def row(self) -> dict:
    """The step's row keys: each metric's mean over the updates, `optimizer_updates`, `clip_frac_first` and
    `clip_frac_last` (the first update's and the last's)."""
    if not self.metrics:
      return {}
    keys = [k for k in self.metrics[0] if all(k in m for m in self.metrics)]
    row = {k: float(np.mean([m[k] for m in self.metrics])) for k in keys}
    row.update(optimizer_updates=float(len(self.metrics)))
    if "clip_frac" in self.metrics[0]:
      row.update(clip_frac_first=self.metrics[0]["clip_frac"], clip_frac_last=self.metrics[-1]["clip_frac"])
    return row


class StepUpdates:
  """A step's updates over `batcher`: the mini-batch being filled, the batches kept for later passes, the copy of the
  step's starting weights. `begin(state, before_update)`, then `add(state, batch, groups)` for each arriving batch,
  then `end(state) -> (state, UpdateRecord)`."""

  def __init__(self, trainer: Trainer, batcher: MicroBatcher, config: TrainerConfig, groups_per_step: int,
               clock: PhaseClock | None = None):
    """`clock`: the trainer thread's; the updates are its "optimizer" phase."""
    self.trainer, self.batcher, self.clock = trainer, batcher, clock or PhaseClock(("optimizer",))
    self.epochs, self.bounds = config.epochs, mini_batch_bounds(groups_per_step, config.mini_batches)
    self.own_old = (config.updates > 1 and trainer.role == "policy"
                    and config.objective.old_logprobs == "recompute")  # the step's starting weights kept
    self._start(None, lambda: 0.0)

  def _start(self, start_params, before_update: Callable[[], float]) -> None:
    self.start_params, self.before_update = start_params, before_update
    self.kept: list[list[dict]] = [[]]  # each mini-batch's batches
    self.groups: set = set()  # groups of the mini-batch being filled
    self.done = 0  # groups of the closed mini-batches
    self.record = UpdateRecord()

  def begin(self, state, before_update: Callable[[], float]) -> None:
    """A new step at `state`; `before_update()` runs before its first update (waits for what reads the weights the
    update donates) and returns the seconds it waited."""
    self._start(launch.copy(state.params) if self.own_old else None, before_update)

  @property
  def pending(self) -> bool:
    """Whether rows wait for an update."""
    return self.batcher.rows_seen > 0

  def add(self, state, batch: dict, groups: np.ndarray):
    """Trains `batch` (a shard's rows: its groups whole, `groups` each row's) in the current mini-batch, updating
    whenever one is complete; returns the state."""
    while len(groups):
      bound = self.bounds[len(self.kept) - 1]  # the groups trained once this mini-batch is complete
      last = len(self.kept) == len(self.bounds)  # the last one takes the rest
      cut = len(groups) if last else split_at_group(groups, self.groups, bound - self.done - len(self.groups))
      if cut:
        self.groups.update(groups[:cut].tolist())
        state = self._train(state, {k: v[:cut] for k, v in batch.items()})
      batch, groups = {k: v[cut:] for k, v in batch.items()}, groups[cut:]
      if not last and self.done + len(self.groups) == bound:
        state = self._close(state)
    return state

  def end(self, state):
    """The last mini-batch's update, then the later passes over the step's kept batches; (state, UpdateRecord)."""
    if self.kept[-1]:
      state = self._close(state)
    passes = [batches for batches in self.kept if batches]
    for _ in range(1, self.epochs):
      for batches in passes:
        for batch in batches:
          state = self._train(state, batch, keep=False)
        state = self._update(state, batches)
    record, self.start_params = self.record, None
    return state, record

  def _train(self, state, batch: dict, keep: bool = True):
    """Accumulates `batch`, with the starting weights' log-probabilities where the weights have moved since."""
    if self.own_old and self.record.metrics and "old_logprobs" not in batch:
      batch["old_logprobs"] = self.trainer.policy_logprobs(self.start_params, batch)
    if keep:
      self.kept[-1].append(batch)
    return self.batcher.add(state, batch)

  def _close(self, state):
    """The current mini-batch's update; the next one begins."""
    state = self._update(state, self.kept[-1])
    self.done += len(self.groups)
    self.groups = set()
    self.kept.append([])
    return state

  def _update(self, state, batches: list[dict]):
    """One optimizer update over what the batcher holds (`batches`); none for batches without a loss token (their
    rows are dropped: they add nothing)."""
    if not self.pending:
      return state
    if not any(np.any(b["loss_mask"]) for b in batches):
      self.batcher.discard()
      return state
    if not self.record.metrics:
      self.record.waited_s += self.before_update()
    with self.clock.phase("optimizer"):
      state, metrics = self.batcher.finish(state)
    self.record.metrics.append(metrics)
    return state
