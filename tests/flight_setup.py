"""A trainer's Flight server over a controller, and a sender holding a lease, for the Flight tests."""

from streamrl_jax.messages import LeaseRequest, Published, Register
from streamrl_jax.models import CharTokenizer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.controller import Controller, JoinTerms
from streamrl_jax.streaming import SampleQueue
from streamrl_jax.streaming.flight_client import FlightConnection, FlightSampleSender
from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
from streamrl_jax.tasks import ArithmeticTask
from streamrl_jax.pipeline.parts import controller_setup
from tests.wire_samples import VOCAB


CONFIG = PipelineConfig(mode="stream", steps=2, prompts_per_step=4, group_size=2, max_new_tokens=8)


SETTINGS = {"PipelineConfig.mode": "'stream'"}


def make_server(capacity=8, tls=None, precision=None, **kwargs):
  controller = Controller(controller_setup(CONFIG), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0,
                          terms=JoinTerms(SETTINGS))
  queue, store = SampleQueue(capacity), HostWeightStore(precision=precision)
  server = TrainerFlightServer("127.0.0.1", 0, controller=controller, samples=queue, weights=store,
                               limits=ServerLimits(VOCAB, **kwargs), tls=tls)
  return server, controller, queue, store


def leased_sender(connection, controller) -> FlightSampleSender:
  """A registered sampler holding the lease of step 0 (groups 0..3, the run's only sampler)."""
  sampler_id = controller.register(Register("s", SETTINGS)).sampler_id
  controller.published(Published(0))
  assert controller.lease(LeaseRequest(sampler_id, 0.0)).lease.group_ids == (0, 1, 2, 3)
  return FlightSampleSender(connection, sampler_id)


def serving(**kwargs):
  """A server (its controller, queue and store) and a client connection to it; both closed afterwards."""
  server, controller, queue, store = make_server(**kwargs)
  connection = FlightConnection(server.address, timeout_s=10, retry_s=5)
  try:
    yield server, controller, queue, store, connection
  finally:
    connection.close()
    server.shutdown()
