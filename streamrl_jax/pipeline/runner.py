"""The four run modes in one process: a sampler worker on a thread, the trainer worker on the caller's, and
the controller between them, joined by the in-process transports (a bounded `SampleQueue` for samples, a
`WeightSync` for weights). Across processes the same workers run in `streamrl trainer` and `streamrl
sampler` over Arrow Flight (`pipeline.remote`).

  colocated      one mesh; generation of step j needs version j; training waits for the whole batch
  disaggregated  two meshes; as colocated, across meshes, with a weight sync per step
  stream         two meshes; the trainer takes each group as it arrives (dynamic-batch pipelining);
                 generation of step j still needs version j, so training stays on-policy
  async          two meshes; generation of step j needs version >= j - staleness and picks up newer
                 weights between decode steps; the trainer streams as in `stream`

Every mode dispatches a step's requests over the sampler replicas by `SchedulingConfig` (random + FIFO, or
the output-length ranker's skew-aware plan), and may add or retire a replica between decode steps.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.config import MeshShape
from streamrl_jax.meshes import build_meshes, mesh_from_devices
from streamrl_jax.models import state_shardings
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.pipeline.sampler_worker import SamplerWorker
from streamrl_jax.pipeline.trainer_worker import TrainerWorker
from streamrl_jax.resources import resident_mb
from streamrl_jax.scheduling import OnlineRanker
from streamrl_jax.streaming import QueueClosed, SampleQueue, WeightSync


@dataclasses.dataclass
class RunResult:
  params: nnx.State
  metrics: list[dict]
  counters: dict
  timeline: dict  # name -> list of (start, end, label) busy intervals, seconds from the run's start


def _meshes(config: PipelineConfig, devices):
  devices = list(jax.devices() if devices is None else devices)
  if config.spec.shared_mesh:
    return (mesh_from_devices(devices, MeshShape(len(devices), 1, 1)),
            mesh_from_devices(devices, MeshShape(1, len(devices), 1)))
  return build_meshes(config.mesh, devices)


def make_ranker(config: PipelineConfig, mesh, checkpointer=None, resume: bool = False) -> OnlineRanker | None:
  """The output-length ranker for skew-aware scheduling (None otherwise), restored with a resumed run."""
  if config.scheduling.policy != "skew_aware":
    return None
  ranker = OnlineRanker(config.scheduling.ranker, mesh)
  if resume:
    try:
      ranker.load_state_arrays(checkpointer.restore_aux({"ranker": ranker.state_arrays()})["ranker"])
    except FileNotFoundError as err:  # saved by a run without the ranker: it starts fresh and learns online
      warnings.warn(f"{err}; the output-length ranker starts untrained", stacklevel=3)
  return ranker


def ranker_aux(ranker: OnlineRanker | None) -> Callable[[], dict] | None:
  return None if ranker is None else (lambda: {"ranker": ranker.state_arrays()})


def timeline_of(trainer: TrainerWorker, controller: Controller, start_epoch: float) -> dict:
  """Busy intervals per lane (each sampler, the trainer, weight syncs), seconds from the run's start."""
  lanes = {name: [(b - start_epoch, e - start_epoch, label) for b, e, label in spans]
           for name, spans in sorted(controller.busy.items())}
  return {**lanes, **trainer.timeline}


def memory_probe(queue: SampleQueue) -> Callable[[], dict]:
  """Per-step figures of this process's memory and the sample queue's depth (now, and the most so far)."""
  def probe() -> dict:
    stats = queue.stats()
    return dict(rss_mb=resident_mb(), queue_depth=stats["depth"], queue_max_depth=stats["max_depth"])
  return probe


def run_pipeline(config: PipelineConfig, model, tokenizer, task, *, devices=None, params=None,
                 on_step: Callable[[dict], None] | None = None, checkpointer=None, resume: bool = False) -> RunResult:
  """Runs RL steps up to `config.steps`; returns the trained parameters, per-step metrics, counters, timeline.

  With a `Checkpointer`, the trainer state is saved after every step (asynchronously); `resume=True`
  restores the latest one and continues with the next step. Samples generated for a step that was not
  trained yet (in flight at a stop) are generated again on resume: no prompt is skipped or trained twice.
  """
  graphdef, initial = nnx.split(model)
  params = initial if params is None else params
  sampler_mesh, trainer_mesh = _meshes(config, devices)
  trainer = TrainerWorker(config, graphdef, params, trainer_mesh, checkpointer=checkpointer, resume=resume)
  ranker = make_ranker(config, sampler_mesh, checkpointer, resume)
  controller = Controller(config, task, tokenizer, start_step=trainer.start_step, ranker=ranker)
  queue = SampleQueue(config.queue_capacity)
  sync = WeightSync(state_shardings(params, sampler_mesh),
                    cast_dtype=jnp.dtype(config.sync_dtype) if config.sync_dtype else None)
  sampler = SamplerWorker(config, graphdef, model.config, tokenizer, task, sampler_mesh)
  stop, errors = threading.Event(), []

  def sample() -> None:
    try:
      sampler.run(controller, queue, sync, stop)
    except BaseException as err:
      if not (isinstance(err, QueueClosed) and stop.is_set()):  # a stop closes the queue under a put
        errors.append(err)
    finally:
      queue.close()

  def get_shard():
    try:
      return queue.get()
    except QueueClosed:
      raise RuntimeError("the sampler stopped before the run was complete") from (errors[0] if errors else None)

  start_epoch = time.time()
  thread = threading.Thread(target=sample, daemon=True, name="sampler")
  thread.start()
  if ranker is not None:
    ranker.start()
  try:
    metrics = trainer.run(controller, get_shard, sync, clock=lambda: time.time() - start_epoch, on_step=on_step,
                          aux=ranker_aux(ranker), probe=memory_probe(queue))
  finally:
    stop.set()
    controller.finish()
    queue.close()
    thread.join()
    sync.wait()
    if ranker is not None:
      ranker.stop()
    if checkpointer is not None:
      checkpointer.wait()
  if errors:
    raise RuntimeError("the sampler thread failed") from errors[0]
  counters = dict(controller.counters, **trainer.counters, **{f"queue_{k}": v for k, v in queue.stats().items()})
  return RunResult(jax.tree.map(np.asarray, trainer.state.params), metrics, counters,
                   timeline_of(trainer, controller, start_epoch))
