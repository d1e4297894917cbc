"""The four run modes in one process: a sampler worker on a thread, the trainer worker on the caller's, and
the controller between them, joined by the in-process transports (a bounded `SampleQueue` for samples, a
`WeightSync` for weights). Across processes the same workers run in `streamrl trainer` and `streamrl
sampler` over Arrow Flight (`pipeline.trainer.program`, `pipeline.sampler.program`); the trainer's side of
both is `pipeline.trainer.session`.

  colocated      one mesh; generation of step j needs version j; training waits for the whole batch
  disaggregated  two meshes; as colocated, across meshes, with a weight sync per step
  stream         two meshes; the trainer takes each group as it arrives (dynamic-batch pipelining);
                 generation of step j still needs version j, so training stays on-policy
  async          two meshes; generation of step j needs version >= j - staleness and picks up newer
                 weights between decode steps; the trainer streams as in `stream`

Every mode dispatches a step's requests over the engine instances by `SchedulingConfig` (random + FIFO, or
the output-length ranker's skew-aware plan), and may add or retire an instance between decode steps.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
from flax import nnx

from streamrl_jax.meshes import pipeline_meshes
from streamrl_jax.models.peft_io import resolve
from streamrl_jax.models.precision import landing
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.arms.followers import ArmsStart, make_followers, spare_devices
from streamrl_jax.pipeline.sampler.worker import SamplerWorker
from streamrl_jax.pipeline.trainer.session import (RunResult, SamplersSide, initial_weights_donated, make_ranker,
                                                   train_session)
from streamrl_jax.pipeline.parts import controller_setup, sampler_setup, trainer_setup
from streamrl_jax.pipeline.trainer.worker import TrainerWorker
from streamrl_jax.rewards import RewardError
from streamrl_jax.streaming import QueueClosed, SampleQueue, WeightSync


def run_pipeline(config: PipelineConfig, model, tokenizer, task, *, devices=None, params=None,
                 hooks: RunHooks = RunHooks()) -> RunResult:
  """Runs RL steps up to `config.steps`; returns the trained parameters, per-step metrics, counters, timeline.

  `hooks` (`RunHooks`): checkpoints and resume, the stop request, where rows and the end go, arms' outputs,
  periodic evaluation. Samples generated for a step that was not trained yet (in flight at a stop) are generated
  again on resume: no prompt is skipped or trained twice. With `config.arms.followers`, the follower arms train on the lead's
  stream, each on devices neither mesh uses while they last (else on the trainer's mesh); each arm's `RunResult`
  is in the result's `arms`.
  """
  if config.arms.followers and config.arms.programs:
    raise ValueError("ArmsConfig.programs: follower programs read from a trainer program's Flight server; "
                     "run `streamrl launch local --arms ...` (or `streamrl trainer` and `streamrl follower`)")
  config = config.resolved(model.config.dtype)  # SamplerConfig.precision='auto': the weights in the model's dtype
  if config.trainer.lora.init_from and not config.trainer.lora.rank:  # the adapter's rank, alpha and targets
    trainer = dataclasses.replace(config.trainer, lora=resolve(config.trainer.lora, model.config))
    config = dataclasses.replace(config, trainer=trainer)
  graphdef, initial = nnx.split(model)
  params = initial if params is None else params
  sampler_mesh, trainer_mesh = pipeline_meshes(config.mesh, config.spec.shared_mesh, devices)
  spare = spare_devices(devices, sampler_mesh, trainer_mesh)  # the run's own pools take them first, arms the rest
  trainer = TrainerWorker(trainer_setup(config, spare, tokenizer), graphdef, params, trainer_mesh,
                          checkpointer=hooks.checkpointer, resume=hooks.resume, stop=hooks.stop)
  ranker = make_ranker(config.scheduling, sampler_mesh, hooks.checkpointer, hooks.resume)
  setup = controller_setup(config)
  controller = Controller(setup, task, tokenizer, start_step=trainer.start_step, ranker=ranker)
  queue = SampleQueue(config.trainer.wait.queue_capacity)
  lora_base = dict(base=params,
                   lora_scale=config.trainer.lora.scale) if config.trainer.lora.enabled else {}  # LoRA: adapters sync
  sync = WeightSync(landing(trainer.state.params if lora_base else params, config.precision, sampler_mesh,
                            **lora_base), config.precision)
  followers = make_followers(trainer.setup, config.arms, graphdef, params, trainer_mesh,
                             spare[trainer.setup.pool_devices:],
                             ArmsStart(trainer.start_step, hooks.resume, hooks.arm_outputs, hooks.periodic_eval))
  sampler = SamplerWorker(sampler_setup(config), graphdef, model.config,
                          tokenizer, task, sampler_mesh)
  if hooks.donate_model:
    initial_weights_donated(config.arms, initial, trainer)
  thread, get_shard, halt, errors = _sampler_thread(sampler, controller, queue, sync)

  def teardown() -> None:
    halt.set()
    controller.finish()
    queue.close()
    thread.join()
  side = SamplersSide(get_shard, start=thread.start, teardown=teardown, to_host=lambda p: jax.tree.map(np.asarray, p))
  result = train_session(trainer, controller, sync, queue, side, hooks, ranker=ranker, followers=followers)
  if errors:
    raise RuntimeError("the sampler thread failed") from errors[0]
  return result


def _sampler_thread(sampler: SamplerWorker, controller: Controller, queue: SampleQueue, sync: WeightSync):
  """The sampler's thread (not started), the trainer's `get_shard` over the queue, the event that halts the
  sampler, and the errors it ended with (the first one raised to the trainer, in its own words for a reward's)."""
  halt, errors = threading.Event(), []

  def sample() -> None:
    try:
      sampler.run(controller, queue, sync, halt)
    except BaseException as err:
      if not (isinstance(err, QueueClosed) and halt.is_set()):  # a stop closes the queue under a put
        errors.append(err)
    finally:
      sampler.close()
      queue.close()

  def get_shard(timeout: float):
    try:
      return queue.get(timeout)
    except QueueClosed:
      if errors and isinstance(errors[0], RewardError):  # the user's reward failed: say so, in its words
        raise errors[0] from None
      raise RuntimeError("the sampler stopped before the run was complete") from (errors[0] if errors else None)

  return threading.Thread(target=sample, daemon=True, name="sampler"), get_shard, halt, errors
