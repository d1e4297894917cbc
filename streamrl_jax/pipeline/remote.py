"""The trainer and the sampler as separate programs joined by Arrow Flight: `serve_training` runs the
trainer worker and the controller behind the trainer's Flight server; `run_sampler` runs a sampler worker
against it. The workers are those of the in-process `run_pipeline`; only the transports differ.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

from streamrl_jax.distributed import broadcast_shard, gather_to_host, is_leader
from streamrl_jax.meshes import role_mesh
from streamrl_jax.messages import Heartbeat
from streamrl_jax.models import Transformer, state_shardings
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.pipeline.runner import RunResult, make_ranker, memory_probe, ranker_aux, timeline_of
from streamrl_jax.pipeline.sampler_worker import SamplerWorker
from streamrl_jax.pipeline.trainer_worker import TrainerWorker
from streamrl_jax.streaming import SampleQueue, cast_floats
from streamrl_jax.streaming.flight_client import (FlightConnection, FlightControl, FlightSampleSender,
                                                  FlightWeightReceiver)
from streamrl_jax.streaming.flight_server import HostWeightStore, TLSFiles, TrainerFlightServer
from streamrl_jax.streaming.sample_schema import WireLimits


@dataclasses.dataclass(frozen=True)
class FlightConfig:
  """How the trainer and its samplers reach each other across processes."""

  heartbeat_s: float = 2.0  # a sampler's heartbeat period
  lease_timeout_s: float = 10.0  # a sampler silent this long is declared lost; its leases go to the others
  call_timeout_s: float = 60.0  # deadline of one call
  connect_retry_s: float = 300.0  # how long a sampler keeps trying to reach the trainer (a warm-up, a restart)
  sampler_timeout_s: float = 600.0  # the trainer gives up when no sampler has been heard from for this long
  finish_grace_s: float = 15.0  # after the last step: how long the trainer waits for samplers to learn it

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if getattr(self, field.name) <= 0:
        raise ValueError(f"FlightConfig.{field.name} must be > 0, got {getattr(self, field.name)}")
    if self.lease_timeout_s <= self.heartbeat_s:
      raise ValueError(f"FlightConfig.lease_timeout_s ({self.lease_timeout_s}) must exceed heartbeat_s "
                       f"({self.heartbeat_s}), or every sampler would be declared lost between two beats")


def parse_address(address: str, flag: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{flag} {address!r}: expected HOST:PORT (port 0 picks a free one)")
  return host, int(port)


def serve_training(config: PipelineConfig, model, tokenizer, task, *, listen: str = "127.0.0.1:0",
                   tls: TLSFiles | None = None, settings: dict | None = None, flight_config: FlightConfig = FlightConfig(),
                   on_step: Callable[[dict], None] | None = None, checkpointer=None, resume: bool = False,
                   on_listening: Callable[[str], None] | None = None, devices=None, log=print,
                   on_event: Callable[[dict], None] | None = None) -> RunResult:
  """The trainer program's run: serves samplers over Flight until `config.steps` are trained. `devices`:
  the trainer's (default: all of this program's, across its processes). In a trainer of several processes,
  process 0 serves and the others follow it step by step (`distributed.broadcast_shard`). `on_event` gets
  the controller's events (samplers joining, leaving, lost); by default they are logged."""
  if config.spec.shared_mesh:
    raise ValueError("PipelineConfig.mode='colocated' time-shares one mesh in one program: run `streamrl train`")
  graphdef, params = nnx.split(model)
  if jax.process_count() > 1:  # every process starts from process 0's weights
    params = multihost_utils.broadcast_one_to_all(params)
  mesh = role_mesh(config.mesh, "trainer", devices)
  trainer = TrainerWorker(config, graphdef, params, mesh, checkpointer=checkpointer, resume=resume)
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  ranker = make_ranker(config, role_mesh(dataclasses.replace(config.mesh, trainer_devices=0), "trainer", local),
                       checkpointer, resume)
  if not is_leader():
    return _follow(config, trainer, ranker)
  controller = Controller(config, task, tokenizer, start_step=trainer.start_step, settings=settings, ranker=ranker,
                          heartbeat_s=flight_config.heartbeat_s, lease_timeout_s=flight_config.lease_timeout_s,
                          summary_timeout_s=flight_config.sampler_timeout_s,
                          on_event=on_event or (lambda e: log(describe_event(e))))
  queue = SampleQueue(config.queue_capacity)
  store = HostWeightStore(cast_dtype=jnp.dtype(config.sync_dtype) if config.sync_dtype else None,
                          gather=gather_to_host if jax.process_count() > 1 else None)
  server = TrainerFlightServer(*parse_address(listen, "--listen"), controller=controller, samples=queue, weights=store,
                               limits=WireLimits.of_run(config, model.config.vocab_size), tls=tls)
  log(f"trainer mesh {dict(mesh.shape)} over {jax.process_count()} process(es); samplers connect to {server.address}")
  if on_listening is not None:
    on_listening(server.address)
  get_shard = _waiting_get(queue, controller, flight_config, log)
  start_epoch = time.time()
  if ranker is not None:
    ranker.start()
  controller.start_watchdog()
  try:
    metrics = trainer.run(controller, _broadcasting(get_shard) if jax.process_count() > 1 else get_shard, store,
                          clock=lambda: time.time() - start_epoch, on_step=on_step, aux=ranker_aux(ranker),
                          probe=memory_probe(queue))
  finally:
    controller.finish()
    controller.wait_samplers_left(flight_config.finish_grace_s)
    controller.close()
    server.shutdown()
    store.wait()
    if ranker is not None:
      ranker.stop()
    if checkpointer is not None:
      checkpointer.wait()
  counters = dict(controller.counters, **trainer.counters, **{f"queue_{k}": v for k, v in queue.stats().items()},
                  **{f"flight_{k}": v for k, v in server.counters.items()})
  return RunResult(gather_to_host(trainer.state.params), metrics, counters, timeline_of(trainer, controller, start_epoch))


def _broadcasting(get_shard):
  """get_shard on process 0 that hands each shard to the trainer's other processes (None tells them to stop)."""
  def get():
    try:
      shard = get_shard()
    except BaseException:
      broadcast_shard(None)
      raise
    return broadcast_shard(shard)
  return get


class _Follower:
  """What a non-leading trainer process has instead of the controller and the weight store: it joins the
  collectives (shards, weight gathers) and keeps nothing."""

  def __init__(self, cast_dtype):
    self.cast_dtype, self.seconds = cast_dtype, {}

  def published(self, version: int) -> None:
    pass

  def set_target_instances(self, instances: int) -> None:
    pass

  def step_summary(self, step: int) -> dict:
    return dict(generation_s=0.0, sampler_instances=1)

  def sampler_wait_s(self) -> float:
    return 0.0

  def publish(self, params, version: int) -> None:
    gather_to_host(cast_floats(params, self.cast_dtype))

  def wait(self) -> None:
    pass


def _follow(config: PipelineConfig, trainer: TrainerWorker, ranker) -> RunResult:
  def get():
    shard = broadcast_shard(None)
    if shard is None:
      raise RuntimeError("the trainer's process 0 stopped the run")
    return shard
  follower = _Follower(jnp.dtype(config.sync_dtype) if config.sync_dtype else None)
  trainer.run(follower, get, follower, clock=time.monotonic, aux=ranker_aux(ranker))
  if trainer.checkpointer is not None:
    trainer.checkpointer.wait()
  return RunResult(gather_to_host(trainer.state.params), [], dict(trainer.counters), {})


def _waiting_get(queue: SampleQueue, controller: Controller, flight_config: FlightConfig, log):
  """queue.get that says when it waits for samplers, and gives up once none has been heard from for
  `sampler_timeout_s`."""
  def get():
    waited, said = 0.0, False
    while True:
      try:
        return queue.get(timeout=1.0)
      except TimeoutError:
        waited += 1.0
      silent = controller.silent_s()
      if silent is None and waited >= 10 and not said:
        log(f"waiting for samplers to connect ({controller.counters['registered']} registered)")
        said = True
      if (silent if silent is not None else waited) > flight_config.sampler_timeout_s:
        raise RuntimeError(f"no sampler has been heard from for {flight_config.sampler_timeout_s:.0f} s "
                           f"(FlightConfig.sampler_timeout_s); start `streamrl sampler --connect` to this trainer")
  return get


def abstract_model(model_config):
  """(graphdef, parameter structure without values) of a model config."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))


def describe_event(event: dict) -> str:
  """One log line for a controller event."""
  kind, name = event["event"], event.get("sampler", "")
  if kind == "sampler_joined":
    return f"sampler {name} joined (takes leases from step {event['next_step']})"
  if kind == "sampler_left":
    return f"sampler {name} left; {event['leases_returned']} lease(s) returned to the plan"
  if kind == "sampler_lost":
    return (f"sampler {name} is silent past FlightConfig.lease_timeout_s: declared lost, "
            f"{event['leases_returned']} lease(s) leased again")
  if kind == "re_leased_delivered":
    return (f"prompts of lost sampler {event['lost_sampler']} (step {event['step']}) delivered by {name}, "
            f"{event['since_lost_s']} s after the loss")
  if kind == "shard_refused":
    return event["reason"]
  if kind == "trainer_paused":
    return f"this trainer was paused for {event['seconds']} s; samplers get a fresh heartbeat timeout"
  return f"{kind}: {event}"


def run_sampler(config: PipelineConfig, model_config, tokenizer, task, *, connect: str, tls: TLSFiles | None = None,
                name: str = "sampler", settings: dict | None = None, flight_config: FlightConfig = FlightConfig(),
                stop: threading.Event | None = None, devices=None, log=print) -> dict:
  """The sampler program's run: takes leases from the trainer at `connect` until it says the run is over.
  When the trainer no longer knows it (it was declared lost, or the trainer restarted), it drops the lease
  in hand, registers again and fetches the weights anew. `devices`: the sampler's (default: all of this
  program's). Returns the sampler's transport statistics."""
  parse_address(connect, "--connect")
  stop = stop or threading.Event()
  connection = FlightConnection(connect, tls=tls, timeout_s=flight_config.call_timeout_s,
                                retry_s=flight_config.connect_retry_s, log=log)
  control = FlightControl(connection)
  mesh = role_mesh(config.mesh, "sampler", devices)
  graphdef, abstract = abstract_model(model_config)
  shardings = state_shardings(abstract, mesh)
  worker = SamplerWorker(config, graphdef, model_config, tokenizer, task, mesh, name=name, settings=settings)
  sender = FlightSampleSender(connection, -1)
  stats = dict(sessions=0, weights_fetches=0, weights_bytes=0, weights_fetch_s=0.0)
  try:
    while not stop.is_set():
      sampler_id = worker.register(control)
      stats["sessions"] += 1
      log(f"{name}: registered with the trainer at {connect} as sampler {sampler_id:x}"
          + (" (again)" if stats["sessions"] > 1 else ""))
      sender.sampler_id = sampler_id
      outcome = _session(worker, control, sender, FlightWeightReceiver(connection, abstract, shardings), sampler_id,
                         flight_config.heartbeat_s, stop, stats)
      if outcome != "rejoin":
        break
      log(f"{name}: the trainer no longer knows sampler {sampler_id:x} (declared lost, or restarted); its lease "
          f"is dropped, registering again")
  finally:
    connection.close()  # calls still retrying give up at once
    connection.client.close()
  return dict(sender.stats, **stats, **connection.counters)


def _session(worker: SamplerWorker, control, sender, receiver, sampler_id: int, period: float,
             stop: threading.Event, stats: dict) -> str:
  """One registration's serve loop with its heartbeat thread and weight receiver; returns serve's outcome."""
  ended, rejoin, errors = threading.Event(), threading.Event(), []
  beat = threading.Thread(target=_heartbeat, args=(control, sampler_id, period, stop, ended, rejoin, errors),
                          daemon=True, name="heartbeat")
  beat.start()
  try:
    outcome = worker.serve(control, sender, receiver, stop, rejoin)
  finally:
    ended.set()
    receiver.close()
    beat.join()
    for key, value in receiver.stats.items():
      stats[f"weights_{key}"] += value
  if errors:
    raise errors[0]
  return outcome


def _heartbeat(control: FlightControl, sampler_id: int, period: float, stop: threading.Event, ended: threading.Event,
               rejoin: threading.Event, errors: list) -> None:
  """Beats every `period` s until the session ends; sets `stop` when the trainer says the run is over or
  cannot be reached, `rejoin` when it no longer knows this sampler."""
  try:
    while not ended.wait(period) and not stop.is_set():
      reply = control.heartbeat(Heartbeat(sampler_id))
      if reply.stop:
        stop.set()
      elif reply.rejoin:
        rejoin.set()
        return
  except BaseException as err:
    if not stop.is_set() and not ended.is_set():  # a call cut short by the end of the run is no error
      errors.append(err)
    stop.set()
