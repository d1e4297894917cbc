"""The trainer's side of a run, shared by the in-process run (`runner.run_pipeline`) and the trainer program
(`trainer.program.serve_training`): the output-length ranker, the trainer worker's steps, the teardown in
order, the merged counters and the `RunResult`. The two differ only in where shards come from, where
weights go and what they stop at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
from flax import nnx

from streamrl_jax import launch
from streamrl_jax.arms.config import ArmsConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.arms.followers import Followers
from streamrl_jax.records.metric_table import PROCESS, check_row
from streamrl_jax.arms.remote import RemoteArms
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.pipeline.trainer.worker import TrainerWorker
from streamrl_jax.resources import resident_mb
from streamrl_jax.scheduling import OnlineRanker, SchedulingConfig
from streamrl_jax.streaming import SampleQueue

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
  params: nnx.State
  metrics: list[dict]
  counters: dict
  timeline: dict  # name -> list of (start, end, label) busy intervals, seconds from the run's start
  adapters: nnx.State | None = None  # LoRA: the trained adapters (`params` then holds them merged into the base)
  arms: dict = dataclasses.field(default_factory=dict)  # follower arm name -> its own RunResult

  def __post_init__(self):
    for row in self.metrics:  # every key of a row is in the metrics table (docs/metrics.md)
      check_row(row)


def make_ranker(scheduling: SchedulingConfig, mesh, checkpointer=None, resume: bool = False) -> OnlineRanker | None:
  """The output-length ranker when the scheduling policy needs one (None otherwise), restored with a
  resumed run."""
  if not scheduling.scheduling_policy.needs_ranker:
    return None
  ranker = OnlineRanker(scheduling.ranker, mesh)
  if resume:
    try:
      ranker.load_state_arrays(checkpointer.restore_aux({"ranker": ranker.state_arrays()})["ranker"])
    except FileNotFoundError as err:  # saved by a run without the ranker: it starts fresh and learns online
      _log.warning("%s; the output-length ranker starts untrained", err)
  return ranker


def ranker_aux(ranker: OnlineRanker | None) -> Callable[[], dict] | None:
  """What a checkpoint keeps of the ranker besides the trainer state."""
  return None if ranker is None else (lambda: {"ranker": ranker.state_arrays()})


def timeline_of(trainer: TrainerWorker, controller: Controller, start_epoch: float) -> dict:
  """Busy intervals per lane (each sampler, the trainer, weight syncs), seconds from the run's start."""
  lanes = {name: [(b - start_epoch, e - start_epoch, label) for b, e, label in spans]
           for name, spans in sorted(controller.busy.items())}
  return {**lanes, **trainer.timeline}


def memory_part(queue: SampleQueue) -> Callable[[dict], dict]:
  """A row part (`metric_table.join_row`): this process's memory and the sample queue's depth (now, and the most so
  far)."""
  def part(row: dict) -> dict:
    stats = queue.stats()
    return {PROCESS: dict(rss_mb=resident_mb(), queue_depth=stats["depth"], queue_max_depth=stats["max_depth"])}
  return part


@dataclasses.dataclass(frozen=True)
class SamplersSide:
  """How a trainer session reaches its samplers, where the in-process run and the trainer program differ:
  `get_shard(timeout)` takes the next shard, `start()` starts the samplers' side and `teardown()` stops it,
  `to_host(params)` brings parameters to the host, `extra_counters()` adds the transport's counters."""

  get_shard: Callable
  start: Callable[[], None]
  teardown: Callable[[], None]
  to_host: Callable
  extra_counters: Callable[[], dict] = dict


def train_session(trainer: TrainerWorker, controller: Controller, weights, queue: SampleQueue, side: SamplersSide,
                  hooks: RunHooks, *, ranker: OnlineRanker | None,
                  followers: Followers | RemoteArms | None = None) -> RunResult:
  """Starts the samplers' side and trains every step with its shards, publishing to `weights`; then, also on
  failure, tears the samplers' side down, waits for the last weight publish, the ranker and the last checkpoint
  (`hooks.checkpointer`). Counters merge the controller's, the trainer's, the queue's and the side's extra ones.
  `hooks.on_end(timeline, counters, arm_counters)` gets them (and each follower arm's counters by name) once the
  steps end, also when they stop or fail. `followers`: follower arms fed every shard the lead takes (`Followers`
  in this program, `RemoteArms` served to follower programs); once the lead is done they train what they hold (a
  stop or failure: only their step in progress). `hooks.periodic_eval` (one process only): the lead's held-out
  accuracy on the rows it is due."""
  start_epoch = time.time()
  get_shard, on_step, to_host, parts = side.get_shard, hooks.on_step, side.to_host, [memory_part(queue)]
  if followers is not None:
    get_shard = followers.fanout.tap(get_shard)
    parts.append(followers.fanout.lead_part)
    followers.start()
  if hooks.periodic_eval is not None:  # the lead's held-out accuracy, of its parameters after the row's step
    parts.append(hooks.periodic_eval.row_part(lambda: to_host(trainer.policy_params())))
  side.start()
  if ranker is not None:
    ranker.start()
  completed, arms = False, {}
  try:
    metrics = trainer.run(controller, get_shard, weights, clock=lambda: time.time() - start_epoch, on_step=on_step,
                          aux=ranker_aux(ranker), row_parts=tuple(parts))
    completed = True
  finally:
    try:
      if followers is not None:  # before the samplers' side stops: follower programs read through its server
        arms = followers.finish(discard=not completed)
    finally:
      side.teardown()
    weights.wait()
    if ranker is not None:
      ranker.stop()
    if hooks.checkpointer is not None:
      hooks.checkpointer.wait()
    counters = dict(controller.counters, **trainer.counters, **{f"queue_{k}": v for k, v in queue.stats().items()},
                    **side.extra_counters())
    if hooks.on_end is not None:
      hooks.on_end(timeline_of(trainer, controller, start_epoch), counters, {n: c for n, (_, c, _) in arms.items()})
  params, adapters = trained_params(trainer, to_host)
  return RunResult(params, metrics, counters, timeline_of(trainer, controller, start_epoch), adapters,
                   _arm_results(arms, to_host))


def _arm_results(arms: dict, to_host: Callable) -> dict[str, RunResult]:
  """Each follower arm's RunResult from what `finish` gave back: (metrics, counters, worker or None if it failed)."""
  results = {}
  for name, (arm_metrics, arm_counters, worker) in arms.items():
    if worker is None:  # it failed: what it saved is in its checkpoints
      results[name] = RunResult(None, arm_metrics, arm_counters, {})
      continue
    arm_params, arm_adapters = trained_params(worker, to_host)
    results[name] = RunResult(arm_params, arm_metrics, arm_counters, {"trainer": worker.timeline["trainer"]},
                              arm_adapters)
  return results


def trained_params(trainer: TrainerWorker, to_host: Callable) -> tuple:
  """(the policy's parameters, LoRA's adapters or None) through `to_host`. Every process of a trainer calls it:
  with several, each step (the adapters' gather, the merge, its gather) is a collective."""
  adapters = to_host(trainer.state.params) if trainer.lora else None
  return to_host(trainer.policy_params()), adapters


def initial_weights_donated(arms: ArmsConfig, initial, trainer: TrainerWorker) -> None:
  """Frees the caller's initial weights once the trainer holds its copy (`launch.delete`): a run would otherwise
  keep a dead copy of the model to its end (on a CPU, SmolLM2's 0.5 GB of RAM). Kept where they stay in use:
  LoRA's frozen base is the model's own arrays, and follower arms (`arms.followers`) copy them when they start."""
  if trainer.lora is not None or arms.followers:
    return
  jax.block_until_ready(trainer.state.params)
  launch.delete(initial)
