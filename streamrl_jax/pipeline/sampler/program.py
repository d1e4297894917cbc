"""The sampler program (`streamrl sampler`): a sampler worker that takes leases from a trainer over Arrow
Flight, with a heartbeat thread, and registers again when the trainer no longer knows it. The worker is the
in-process run's; only the transports differ.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable

from streamrl_jax.meshes import role_mesh
from streamrl_jax.messages import (Ack, Heartbeat, LeaseReply, LeaseRequest, Leave, Register, Registered,
                                   StepReport)
from streamrl_jax.models import ModelConfig, abstract_model, lora
from streamrl_jax.models.precision import landing
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.parts import sampler_setup
from streamrl_jax.pipeline.sampler.worker import SamplerRole, SamplerWorker
from streamrl_jax.pipeline.sampler.routing import RoutedSender
from streamrl_jax.streaming.flight_client import (FlightConnection, FlightControl,
                                                  FlightWeightReceiver, RelayLinks)
from streamrl_jax.streaming.flight_config import FlightConfig, parse_address
from streamrl_jax.streaming.flight_server import TLSFiles
from streamrl_jax.streaming.weight_relay import RelayServer, RelayStore

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplerEndpoint:
  """How a sampler program reaches its trainer and what it offers beside sampling. `connect`: the trainer's
  HOST:PORT; `name`: how the trainer's logs and timeline call it; `settings`: the run's, checked by the trainer at
  registration; `site`: its datacenter's label. With `relay_listen` (HOST:PORT), it serves the weight versions it
  receives to the samplers below it in each version's broadcast tree, at `relay_host` (default: the listen host)
  and the bound port; `relay_tls_name` is the name relays' certificates carry when it is not the address dialled
  (one certificate for every pod). `serve` (a `ServeConfig`): an OpenAI-compatible server on this sampler's engine
  too, answering with the newest weights that landed (mutual TLS with `tls`, as Flight's)."""

  connect: str
  name: str = "sampler"
  tls: TLSFiles | None = None
  flight_config: FlightConfig = FlightConfig()
  settings: dict | None = None
  site: str = ""
  relay_listen: str | None = None
  relay_host: str | None = None
  relay_tls_name: str | None = None
  serve: object = None


SESSION_STATS = ("sessions", "weights_fetches", "weights_bytes", "weights_fetch_s", "weights_relay_fetches",
                 "weights_relay_fallbacks")


def run_sampler(config: PipelineConfig, model_config: ModelConfig, tokenizer, task, *, endpoint: SamplerEndpoint,
                stop: threading.Event | None = None, devices=None, base_params=None) -> dict:
  """The sampler program's run: takes leases from the trainer at `endpoint.connect` until it says the run is over.
  When the trainer no longer knows it (declared lost, or restarted), it drops the lease in hand, registers again and
  fetches the weights anew. `devices`: the sampler's (default: all of this program's). `base_params` (LoRA): the base
  each version's adapters merge into, as the trainer's. Returns the sampler's transport statistics."""
  config = config.resolved(model_config.dtype)  # SamplerConfig.precision='auto': the weights in the model's dtype
  e, stop = endpoint, stop or threading.Event()
  connect, name, tls, flight_config, site = e.connect, e.name, e.tls, e.flight_config, e.site
  parse_address(connect, "--connect")
  if e.relay_listen:
    parse_address(e.relay_listen, "--relay-listen")
  dial = functools.partial(FlightConnection, tls=tls, timeout_s=flight_config.call_timeout_s,
                           retry_s=flight_config.connect_retry_s)
  connection = dial(connect)
  control = FlightControl(connection)
  mesh = role_mesh(config.mesh, "sampler", devices)
  graphdef, abstract = abstract_model(model_config)
  weights = _landing(config, graphdef, abstract, mesh, base_params)
  base_params = None  # a LoRA landing holds the base on the mesh; the host copy goes
  worker = SamplerWorker(sampler_setup(config), graphdef, model_config,
                         tokenizer, task, mesh, role=SamplerRole(name, e.settings, e.serve, tls if e.serve else None))
  sender = RoutedSender(connection, functools.partial(dial, peer="a trainer process's sample door",
                                                      tls_name=connect.rpartition(":")[0] if tls else None))
  stats, relay = dict.fromkeys(SESSION_STATS, 0), None
  try:
    relay = _relay(e)
    while not stop.is_set():
      sampler_id = worker.register(control, site=site, relay=relay.address if relay else "")
      stats["sessions"] += 1
      _log.info(f"{name}: registered with the trainer at {connect} as sampler {sampler_id:x}"
                + (" (again)" if stats["sessions"] > 1 else ""))
      sender.start(sampler_id, worker.data_endpoints)
      receiver = FlightWeightReceiver(connection, weights.template, weights.shardings, finish=weights.finish,
                                      sampler_id=sampler_id, streams=flight_config.weight_streams,
                                      relays=RelayLinks(relay.store if relay else None, tls, e.relay_tls_name,
                                                        sender.doors()))
      outcome = _session(worker, control, sender, receiver, sampler_id, config.controller.heartbeat_s, stop, stats)
      if outcome != "rejoin":
        break
      _log.warning(f"{name}: the trainer no longer knows sampler {sampler_id:x} (declared lost, or restarted); "
                   "its lease is dropped, registering again")
  finally:
    worker.close()
    sender.close()
    connection.close()  # calls still retrying give up at once
    connection.client.close()
    if relay is not None:
      relay.shutdown()
  return dict(sender.stats, **stats, **connection.counters, **(relay.counters if relay else {}))


def _relay(endpoint: SamplerEndpoint) -> RelayServer | None:
  """The relay serving the weight versions this sampler holds to the samplers below it (None without
  `relay_listen`)."""
  if not endpoint.relay_listen:
    return None
  relay = RelayServer(*parse_address(endpoint.relay_listen, "--relay-listen"), RelayStore(), tls=endpoint.tls,
                      advertise=endpoint.relay_host)
  _log.info(f"{endpoint.name}: serves the weights it holds to other samplers at {relay.address} "
            f"(site {endpoint.site!r})")
  return relay


def _landing(config: PipelineConfig, graphdef, abstract, mesh, base_params):
  """Where each weight version lands on the sampler's mesh (`models.precision.landing`); with LoRA a version is the
  adapters, merged into `base_params` placed on the mesh once."""
  if not config.trainer.lora.enabled:
    return landing(abstract, config.precision, mesh)
  if base_params is None:
    raise ValueError("LoraConfig.rank > 0: run_sampler needs base_params (the base the adapters merge into)")
  return landing(lora.adapter_shapes(graphdef, abstract, config.trainer.lora), config.precision, mesh, base=base_params,
                 lora_scale=config.trainer.lora.scale)


def _session(worker: SamplerWorker, control, sender, receiver, sampler_id: int, period: float,
             stop: threading.Event, stats: dict) -> str:
  """One registration's serve loop with its heartbeat thread and weight receiver; returns serve's outcome."""
  ended, rejoin, errors = threading.Event(), threading.Event(), []
  beat = threading.Thread(target=_heartbeat, args=(control, sampler_id, period, stop, ended, rejoin, errors),
                          daemon=True, name="heartbeat")
  beat.start()

  def end_beat() -> None:
    ended.set()
    beat.join()
  try:
    outcome = worker.serve(_SessionControl(control, end_beat), sender, receiver, stop, rejoin)
  finally:
    end_beat()
    receiver.close()
    for key, value in receiver.stats.items():
      stats[f"weights_{key}"] += value
  if errors:
    raise errors[0]
  return outcome


class _SessionControl:
  """A session's control channel: its Leave first ends the session's heartbeat, since a trainer that has seen every
  sampler leave shuts its server down, cancelling the calls under way (a beat cut off so ended its sampler)."""

  def __init__(self, control: FlightControl, before_leave: Callable[[], None]):
    self.control, self.before_leave = control, before_leave

  def register(self, message: Register) -> Registered:
    return self.control.register(message)

  def lease(self, message: LeaseRequest) -> LeaseReply:
    return self.control.lease(message)

  def report(self, message: StepReport) -> Ack:
    return self.control.report(message)

  def leave(self, message: Leave) -> Ack:
    self.before_leave()
    return self.control.leave(message)


def _heartbeat(control: FlightControl, sampler_id: int, period: float, stop: threading.Event, ended: threading.Event,
               rejoin: threading.Event, errors: list) -> None:
  """Beats every `period` s until the session ends; sets `stop` when the trainer says the run is over or
  cannot be reached, `rejoin` when it no longer knows this sampler. A beat cut short by the session's end (a rejoin,
  the run's end) is neither an error nor a stop: the session's outcome decides."""
  try:
    while not ended.wait(period) and not stop.is_set():
      reply = control.heartbeat(Heartbeat(sampler_id), abort=ended)
      if reply.stop:
        stop.set()
      elif reply.rejoin:
        rejoin.set()
        return
  except BaseException as err:
    if ended.is_set():
      return
    if not stop.is_set():
      errors.append(err)
    stop.set()
