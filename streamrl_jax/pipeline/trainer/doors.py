"""Each trainer process's own door (a trainer of several processes: DistFlow's no central data node).

Process 0's door is the trainer's Flight server, which also holds the control; every other process serves a door
of its own samples and of its own pieces of each weight version (`weight_pieces`), on the host of
`TrainerEndpoint.listen` and a port of its own, whose lease checks ask process 0 (`intake.FlightDoor`). Samplers
learn the doors from `Registered.data_endpoints` and send each group to its owner's (`step_plan.group_owner`); a
door refuses another process's groups.
"""

from __future__ import annotations

import jax

from streamrl_jax.distributed import advertised_host, coordinator_host, gather_text
from streamrl_jax.pipeline.trainer.intake import FlightDoor, ProcessIntake
from streamrl_jax.pipeline.trainer.worker import TrainerSetup
from streamrl_jax.run_shape import RunShape
from streamrl_jax.streaming import SampleQueue
from streamrl_jax.streaming.flight_client import FlightConnection
from streamrl_jax.streaming.flight_config import parse_address
from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
from streamrl_jax.streaming.sample_schema import WireLimits


class SampleDoors:
  """The trainer's sample doors seen from one process: `endpoints` (every door by process, "" for process 0's: the
  address samplers register with), this process's `server` and `queue` when it is not process 0; of a run of
  `shape`."""

  def __init__(self, shape: RunShape, endpoint, server=None, queue=None, endpoints: tuple[str, ...] = ()):
    self.shape, self.endpoint = shape, endpoint
    self.server, self.queue, self.endpoints = server, queue, endpoints
    self.connection: FlightConnection | None = None

  @classmethod
  def open(cls, setup: TrainerSetup, wire: WireLimits, endpoint) -> SampleDoors:
    """Every process other than 0 opens its door (a queue of `WaitConfig.queue_capacity`, weight pieces in the
    samplers' precision); the processes learn each other's (collective)."""
    process, processes, shape = jax.process_index(), jax.process_count(), setup.shape
    if processes == 1:
      return cls(shape, endpoint)
    server = queue = None
    if process:
      host, _ = parse_address(endpoint.listen, "--listen")
      queue = SampleQueue(setup.trainer.wait.queue_capacity)
      limits = ServerLimits(wire, owner=(process, processes),
                            chunk_bytes=endpoint.flight_config.weight_chunk_mb << 20)
      server = TrainerFlightServer(host, 0, controller=FlightDoor(None, shape.group_size), samples=queue,
                                   weights=HostWeightStore(precision=setup.precision, pieces=True), limits=limits,
                                   tls=endpoint.tls)
      server.address = f"{advertised_host(host)}:{server.port}"
    addresses = gather_text(server.address if server else "")
    return cls(shape, endpoint, server, queue, ("",) + tuple(addresses[1:]))

  def connect(self, control_address: str | None) -> None:
    """Process 0 tells the others its server's port (`control_address`; None on the others), where their doors ask
    about each batch, on the host of the cluster's coordinator. Collective."""
    if not self.endpoints:
      return
    port = gather_text(control_address or "")[0].rpartition(":")[2]
    leader = f"{coordinator_host()}:{port}"  # process 0's host, as the cluster's coordinator names it
    if self.server is not None:
      flight = self.endpoint.flight_config
      self.connection = FlightConnection(leader, tls=self.endpoint.tls, timeout_s=flight.call_timeout_s,
                                         retry_s=flight.connect_retry_s, peer="trainer process 0")
      self.server.controller.connection = self.connection

  def intake(self, queue: SampleQueue | None, door_bytes) -> ProcessIntake | None:
    """The processes' shared view of the samples (None for a trainer of one process); `queue`: process 0's."""
    if not self.endpoints:
      return None
    return ProcessIntake(queue if queue is not None else self.queue, len(self.shape.reward_names), door_bytes)

  def close(self) -> None:
    if self.server is not None:
      self.queue.close()
      self.server.shutdown()
    if self.connection is not None:
      self.connection.close()

