"""The trainer program (`streamrl trainer`): the trainer worker and the controller behind the trainer's Arrow
Flight server, samplers in other processes. The trainer's side is the in-process run's
(`trainer.session.train_session`); only the transports differ. A trainer of several processes: process 0
serves, the others follow it step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import jax
from flax import nnx
from jax.experimental import multihost_utils

from streamrl_jax.distributed import gather_to_host, is_leader
from streamrl_jax.meshes import local_mesh, role_mesh
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.controller import Controller, JoinTerms
from streamrl_jax.pipeline.events import describe_event
from streamrl_jax.pipeline.parts import controller_setup, trainer_setup
from streamrl_jax.arms.followers import ArmsStart, make_followers, spare_devices
from streamrl_jax.arms.remote import RemoteArms
from streamrl_jax.pipeline.trainer.control import FollowerControl
from streamrl_jax.pipeline.trainer.doors import SampleDoors
from streamrl_jax.pipeline.trainer.intake import IntakeStopped, ProcessIntake
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.pipeline.trainer.session import (RunResult, SamplersSide, initial_weights_donated, make_ranker,
                                                   ranker_aux, train_session, trained_params)
from streamrl_jax.pipeline.trainer.worker import TrainerWorker
from streamrl_jax.stopping import RunStopped
from streamrl_jax.streaming import SampleQueue
from streamrl_jax.streaming.flight_config import FlightConfig, parse_address
from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TLSFiles, TrainerFlightServer
from streamrl_jax.streaming.sample_schema import WireLimits

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainerEndpoint:
  """Where and how the trainer program serves: `listen` (HOST:PORT; port 0 picks one, told to `on_listening`), mutual
  TLS, Flight's limits, the trainer's datacenter label `site` (samplers of other sites get one copy of each version
  across), and `on_event` for the controller's events (samplers joining, leaving, lost, weight trees; by default
  they are logged)."""

  listen: str = "127.0.0.1:0"
  tls: TLSFiles | None = None
  flight_config: FlightConfig = FlightConfig()
  site: str = ""
  on_listening: Callable[[str], None] | None = None
  on_event: Callable[[dict], None] | None = None


def serve_training(config: PipelineConfig, model, tokenizer, task, *, endpoint: TrainerEndpoint = TrainerEndpoint(),
                   settings: dict | None = None, devices=None, hooks: RunHooks = RunHooks()) -> RunResult:
  """The trainer program's run: serves samplers over Flight at `endpoint` until `config.steps` are trained.
  `devices`: the trainer's (default: all of this program's, across its processes). In a trainer of several
  processes, process 0 holds the control, every process takes its own groups' samples at its own door
  (`trainer.doors`), and all train each step on the same view of what arrived (`trainer.intake`); process 0
  honours `hooks.stop` at a step boundary (`RunStopped`) and the others follow its decision, and only process 0
  gets `hooks.on_end`. Follower arms (`config.arms.followers`, `hooks.arm_outputs` as `run_pipeline`'s) train in
  this program, on devices the trainer's mesh leaves while they last; with `config.arms.programs` they are programs
  of their own, served by this program's Flight server, and `hooks.run_id` names the run they must belong to."""
  config = config.resolved(model.config.dtype)  # SamplerConfig.precision='auto': the weights in the model's dtype
  _check(config)
  graphdef, params = nnx.split(model)
  params = multihost_utils.broadcast_one_to_all(params) if jax.process_count() > 1 else params  # process 0's weights
  mesh = role_mesh(config.mesh, "trainer", devices)
  spare, stop = spare_devices(devices, mesh), hooks.stop if is_leader() else None  # own pools take spares first
  trainer = TrainerWorker(dataclasses.replace(trainer_setup(config, spare, tokenizer), scorer_tls=endpoint.tls),
                          graphdef, params, mesh, checkpointer=hooks.checkpointer, resume=hooks.resume, stop=stop)
  ranker = make_ranker(config.scheduling, local_mesh(mesh), hooks.checkpointer, hooks.resume)
  if hooks.donate_model:
    initial_weights_donated(config.arms, nnx.state(model), trainer)
  wire = WireLimits.of_run(config.sampler.engine, config.samples_per_step, model.config.vocab_size, model.config)
  doors = SampleDoors.open(trainer.setup, wire, endpoint)  # other processes' sample doors, before
  if not is_leader():
    with hooks.stop.deferred("process 0 stops") if hooks.stop is not None else contextlib.nullcontext():
      return _follow(config, trainer, ranker, doors)
  controller = Controller(controller_setup(config), task, tokenizer, start_step=trainer.start_step,
                          terms=JoinTerms(settings, endpoint.site, doors.endpoints), ranker=ranker,
                          on_event=endpoint.on_event or (lambda e: _log.info(describe_event(e))))
  if config.arms.followers and config.arms.programs:
    followers = RemoteArms(config.shape, config.arms, hooks.run_id, trainer.start_step, settings or {})
  else:
    followers = make_followers(trainer.setup, config.arms, graphdef, params, mesh, spare[trainer.setup.pool_devices:],
                               ArmsStart(trainer.start_step, hooks.resume, hooks.arm_outputs, hooks.periodic_eval))
  queue, store, server = _serve(config, controller, wire, endpoint, followers)
  doors.connect(server.address)
  _log.info(f"trainer mesh {dict(mesh.shape)} over {jax.process_count()} process(es); samplers dial {server.address}")
  if endpoint.on_listening is not None:
    endpoint.on_listening(server.address)
  get_shard, intake = _shard_source(config, controller, queue, server, doors)
  try:
    side = SamplersSide(get_shard, start=controller.start_watchdog,
                        teardown=_teardown(config, controller, server, doors), to_host=gather_to_host,
                        extra_counters=lambda: {**{f"flight_{k}": v for k, v in server.counters.items()},
                                                **(intake.row() if intake else {})})
    return train_session(trainer, controller, store, queue, side, hooks, ranker=ranker, followers=followers)
  except RunStopped as stopped:
    if intake is not None and stopped.abandoned_step is not None:  # the others wait for the step's shards: tell
      intake.stop()  # them to stop (at a step boundary they stopped with process 0: `TrainerWorker._finish_step`)
    raise


def _check(config: PipelineConfig) -> None:
  """Refuses what the trainer program does not run: a colocated mode, follower arms beside several processes."""
  if config.spec.shared_mesh:
    raise ValueError("PipelineConfig.mode='colocated' time-shares one mesh in one program: run `streamrl train`")
  if config.arms.followers and jax.process_count() > 1:
    raise ValueError("--arms: follower arms run beside a trainer of one process; this trainer has "
                     f"{jax.process_count()}")
  if config.workflow.own_pools() and jax.process_count() > 1:
    raise ValueError("WorkflowConfig.pools: a pool of the run's own is cut from one trainer process's spare devices; "
                     f"this trainer has {jax.process_count()} processes")
  if config.workflow.remote_pools() and jax.process_count() > 1:
    raise ValueError("WorkflowConfig.pools: a scorer program serves a trainer of one process; this trainer has "
                     f"{jax.process_count()}: put the stage on the pool 'trainer'")


def _teardown(config: PipelineConfig, controller: Controller, server, doors: SampleDoors) -> Callable[[], None]:
  """The end of serving: the run finished, the samplers given `finish_grace_s` to leave, the servers shut down."""
  def teardown() -> None:
    controller.finish()
    controller.wait_samplers_left(config.controller.finish_grace_s)
    controller.close()
    server.shutdown()
    doors.close()
  return teardown


def _serve(config: PipelineConfig, controller: Controller, wire: WireLimits, endpoint: TrainerEndpoint,
           followers):
  """The trainer's door: (sample queue, weight store, the Flight server listening at `endpoint`, serving the
  streams of follower arms that are programs of their own, `RemoteArms`, too)."""
  queue = SampleQueue(config.trainer.wait.queue_capacity)
  store = HostWeightStore(precision=config.precision, pieces=jax.process_count() > 1)  # each process its own pieces
  server = TrainerFlightServer(*parse_address(endpoint.listen, "--listen"), controller=controller, samples=queue,
                               weights=store, tls=endpoint.tls,
                               arms=followers if isinstance(followers, RemoteArms) else None,
                               limits=ServerLimits(wire,
                                                   chunk_bytes=endpoint.flight_config.weight_chunk_mb << 20,
                                                   owner=(0, jax.process_count())))
  return queue, store, server


def _shard_source(config: PipelineConfig, controller: Controller, queue: SampleQueue, server, doors: SampleDoors):
  """(get_shard for the session, the processes' shared intake or None for a trainer of one process)."""
  intake = doors.intake(queue, lambda: (server.counters.accepted_bytes, server.counters.weight_bytes))
  get_shard = _waiting_get(intake or queue, controller, config.controller.sampler_timeout_s)
  return (get_shard if intake is None else _stopping_others(get_shard, intake)), intake


def _stopping_others(get_shard, intake: ProcessIntake):
  """get_shard on process 0 that, when it fails (no sampler heard from, a stop), tells the other processes to stop."""
  def get(timeout: float):
    try:
      return get_shard(timeout)
    except TimeoutError:  # nothing yet: the others keep polling
      raise
    except BaseException:
      intake.stop()
      raise
  return get


def _follow(config: PipelineConfig, trainer: TrainerWorker, ranker, doors: SampleDoors) -> RunResult:
  """A trainer process other than 0: its own sample door, process 0's decisions (the same worker, the same view)."""
  doors.connect(None)
  counters = doors.server.counters
  intake = doors.intake(None, lambda: (counters.accepted_bytes, counters.weight_bytes))

  def get(timeout: float):  # polls as long as process 0 does
    try:
      return intake.get(timeout)
    except IntakeStopped:
      raise RunStopped(trainer.checkpointer.latest_step() if trainer.checkpointer is not None else None) from None
  try:
    trainer.run(FollowerControl(config.shape), get, doors.server.weights, clock=time.monotonic, aux=ranker_aux(ranker))
  finally:
    doors.close()
  if trainer.checkpointer is not None:
    trainer.checkpointer.wait()
  params, adapters = trained_params(trainer, gather_to_host)  # the leader's collectives, in its order
  return RunResult(params, [], dict(trainer.counters, **{f"flight_{k}": v for k, v in doors.server.counters.items()},
                                    **intake.row()), {}, adapters)


def _waiting_get(queue: SampleQueue, controller: Controller, sampler_timeout_s: float):
  """queue.get(timeout) that says when it has waited long for samplers, and gives up once none has been heard
  from for `ControllerConfig.sampler_timeout_s`."""
  waited, said = 0.0, False  # since the last shard

  def get(timeout: float):
    nonlocal waited, said
    try:
      shard = queue.get(timeout=timeout)
    except TimeoutError:
      waited += timeout
      silent = controller.silent_s()
      if silent is None and waited >= 10 and not said:
        _log.info(f"waiting for samplers to connect ({controller.counters.registered} registered)")
        said = True
      if (silent if silent is not None else waited) > sampler_timeout_s:
        raise RuntimeError(f"no sampler has been heard from for {sampler_timeout_s:.0f} s "
                           f"(ControllerConfig.sampler_timeout_s); start `streamrl sampler --connect` to this trainer")
      raise
    waited, said = 0.0, False
    return shard
  return get
