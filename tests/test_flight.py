"""The Arrow Flight transport on loopback: samples (acks, duplicates, malformed batches, backpressure),
weights, control messages, mutual TLS, an unreachable trainer."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.messages import (BadMessage, Heartbeat, LeaseRequest, Published, Register, RejoinRequired, StepReport,
                                   StepSummaryRequest, VersionInfo, VersionQuery)
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.models.precision import SamplerPrecision, decode, encode, landing, to_wire, wire_bytes
from streamrl_jax.streaming.flight_client import (FlightConnection, FlightControl, FlightSampleSender,
                                                  FlightWeightReceiver, TrainerUnreachable)
from streamrl_jax.streaming.flight_server import SAMPLES_COMMAND, TLSFiles
from streamrl_jax.streaming.sample_schema import SAMPLE_SCHEMA, SampleEnvelope, shard_to_batch
from tests.wire_samples import VOCAB, group_shard
from tests.tls_certs import write_test_certificates
from tests.flight_setup import SETTINGS, leased_sender, make_server, serving
from tests.processes import free_port


@pytest.fixture
def served():
  yield from serving()


def test_samples_are_acked_deduplicated_and_malformed_ones_refused(served):
  server, controller, queue, _, connection = served
  stranger = FlightSampleSender(connection, sampler_id=3)  # not registered: refused, told to register again
  with pytest.raises(RejoinRequired):
    stranger.put(group_shard([4, 5], seed=1))
  assert len(queue) == 0 and server.counters["rejoin_refusals"] == 1
  sender = leased_sender(connection, controller)
  sender.put(group_shard([4, 5], seed=1, step=0, group=0))
  sender.seq = 0  # a retry of an acked batch (its ack was lost): acked again as a duplicate, not queued twice
  sender.put(group_shard([4, 5], seed=1, step=0, group=0))
  assert sender.stats["duplicate_acks"] == 1 and len(queue) == 2
  bad = shard_to_batch(group_shard([4, 5]), SampleEnvelope(sender.sampler_id, 7))
  bad = pa.record_batch([pa.array([[1, 2, VOCAB + 5, 1], [1, 2, 3, 4, 5]], pa.list_(pa.int32())) if f.name == "tokens"
                         else bad.column(i) for i, f in enumerate(bad.schema)], schema=bad.schema)
  writer, reader = connection.client.do_put(flight.FlightDescriptor.for_command(SAMPLES_COMMAND), SAMPLE_SCHEMA)
  with pytest.raises(flight.FlightServerError, match=r"row 0: token ids must lie in \[0, 50\)"):
    with writer:
      writer.write_batch(bad)
      writer.done_writing()
      reader.read()
  sender.put(group_shard([3, 3], seed=2, step=0, group=1))  # the connection stays usable
  assert len(queue) == 4 and server.counters["bad_batches"] == 1 and server.counters["duplicate_batches"] == 1
  got = queue.get(timeout=1)
  np.testing.assert_array_equal(got.tokens, group_shard([4, 5], seed=1).tokens[:, :5])
  with pytest.raises(flight.FlightServerError, match="DoPut takes the command"):
    writer, reader = connection.client.do_put(flight.FlightDescriptor.for_command(b"other"), SAMPLE_SCHEMA)
    with writer:
      writer.write_batch(shard_to_batch(group_shard([3]), SampleEnvelope(0, 0)))
      writer.done_writing()
      reader.read()


def test_a_full_queue_makes_the_sender_wait_and_nothing_is_lost():
  server, controller, queue, _ = make_server(capacity=4, put_wait_s=0.05)
  connection = FlightConnection(server.address, timeout_s=10, retry_s=5)
  try:
    sender = leased_sender(connection, controller)
    sent = [group_shard([3, 4], seed=k, step=0, group=k % 4) for k in range(6)]
    thread = threading.Thread(target=lambda: [sender.put(s) for s in sent])
    thread.start()
    deadline = time.monotonic() + 30
    while not server.counters["full_refusals"] and time.monotonic() < deadline:  # a put found the queue full
      time.sleep(0.01)
    assert len(queue) == 4 and thread.is_alive()  # blocked by backpressure, not dropped
    got = [queue.get(timeout=10) for _ in sent]
    thread.join(timeout=10)
    assert not thread.is_alive() and server.counters["full_refusals"] >= 1 and sender.stats["full_retries"] >= 1
    for a, b in zip(got, sent):
      np.testing.assert_array_equal(a.rewards, b.rewards)
  finally:
    connection.close()
    server.shutdown()


def test_control_messages_over_flight(served):
  server, controller, _, _, connection = served
  control = FlightControl(connection)
  with pytest.raises(BadMessage, match=r"first 'PipelineConfig.mode' = \"'async'\" \(sampler\) vs \"'stream'\""):
    control.register(Register("s", {"PipelineConfig.mode": "'async'"}))
  registered = control.register(Register("s", SETTINGS))
  me = registered.sampler_id
  assert registered.steps == 2
  assert control.lease(LeaseRequest(me, wait_s=0.1)).lease is None  # no weights published: the gate is closed
  controller.published(Published(0))
  lease = control.lease(LeaseRequest(me, wait_s=0.1)).lease
  assert lease.step == 0 and lease.group_ids == (0, 1, 2, 3) and lease.min_version == 0
  assert control.lease(LeaseRequest(me, wait_s=0.1)).lease is None  # step 1 needs version 1 (on-policy)
  with pytest.raises(BadMessage, match="1 lengths for 4 prompts"):
    control.report(StepReport(me, lease.lease_id, 0, 1.0, (1.0,), 0.0, 8, 1, ()))
  with pytest.raises(BadMessage, match="which it does not hold"):
    control.report(StepReport(me, lease.lease_id + 1, 0, 1.0, (1.0,), 0.0, 8, 1, ()))
  control.report(StepReport(me, lease.lease_id, 0, 1.0, (1.0, 2.0, 3.0, 4.0), 0.5, 8, 1, ((10.0, 11.0),), 99.0))
  summary = controller.take_step_summary(StepSummaryRequest(0, timeout_s=1)).metrics()
  assert summary["generation_s"] == 1.0 and summary["sampler_rss_mb"] == 99.0
  assert not control.heartbeat(Heartbeat(me)).stop
  stranger = me + 1  # an id this controller never gave (a sampler of a trainer that restarted): register again
  assert control.lease(LeaseRequest(stranger, wait_s=0.1)).rejoin and control.heartbeat(Heartbeat(stranger)).rejoin
  assert control.report(StepReport(stranger, 0, 0, 1.0, (1.0,), 0.0, 8, 1, ())).rejoin
  controller.finish()
  assert control.lease(LeaseRequest(me)).finished and control.heartbeat(Heartbeat(me)).stop
  assert not controller.wait_samplers_left(timeout=0.1)


def test_weights_travel_in_chunks_onto_the_samplers_mesh():
  """int8 weights (quantized on the trainer's side: a quarter of the bytes move) in chunks of 1000 bytes,
  dequantized on the sampler's mesh."""
  precision = SamplerPrecision("int8")
  server, _, _, store = make_server(chunk_bytes=1000, precision=precision)
  connection = FlightConnection(server.address, timeout_s=10, retry_s=5)
  try:
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1)
    _, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    mesh = mesh_from_devices(jax.devices()[:2], MeshShape(2, 1, 1))
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]
    weights = landing(abstract, precision, mesh)
    receiver = FlightWeightReceiver(connection, weights.template, weights.shardings, poll_s=0.2,
                                    finish=weights.finish)
    with pytest.raises(TimeoutError):
      receiver.wait_for(0, timeout=0.3)
    store.publish(params, 0)
    store.publish(jax.tree.map(lambda x: x * 2, params), 1)
    update = receiver.wait_for(1, timeout=30)
    leaf = update.params["layers"][0]["mlp"]["up_proj"][...]
    assert update.version == 1 and leaf.dtype == jnp.float32 and set(leaf.sharding.device_set) == set(jax.devices()[:2])
    expected = decode(encode(jax.tree.map(lambda x: x * 2, params), "int8"))["layers"][0]["mlp"]["up_proj"][...]
    np.testing.assert_allclose(np.asarray(leaf), np.asarray(expected), rtol=1e-6)
    assert receiver.latest().version == 1 and server.counters["weight_streams"] >= 1
    per_version = receiver.stats["bytes"] / receiver.stats["fetches"]  # version 0 may have been fetched too
    assert per_version == wire_bytes(to_wire(params, precision)) < 0.45 * wire_bytes(to_wire(params, SamplerPrecision()))
    receiver.close()
  finally:
    connection.close()
    server.shutdown()


def test_a_closed_receiver_waits_for_its_long_poll_and_fetches_nothing_more():
  """`close` waits for the long poll under way (a Flight call cannot be cancelled, and a thread left in one as the
  process exits aborts it): the poll ends when a version comes, finds the receiver closed, and neither fetches nor
  places the version it heard of."""
  server, _, _, store = make_server()
  connection = FlightConnection(server.address, timeout_s=10, retry_s=5)
  try:
    template = {"w": np.zeros((4,), np.float32)}
    receiver = FlightWeightReceiver(connection, template, None, poll_s=30.0)
    store.publish({"w": np.ones((4,), np.float32)}, 0)
    assert receiver.wait_for(0, timeout=30).version == 0
    deadline = time.monotonic() + 30
    while server.counters["actions"] < 2 and time.monotonic() < deadline:  # the poll for version 1 is under way
      time.sleep(0.01)
    assert server.counters["actions"] == 2
    closing = threading.Thread(target=receiver.close)
    closing.start()
    assert receiver._stop.wait(30)
    assert closing.is_alive() and receiver._thread.is_alive()  # close waits while the poll is under way
    store.publish({"w": np.full((4,), 2.0, np.float32)}, 1)  # the poll returns with version 1 ...
    closing.join(30)
    assert not closing.is_alive() and not receiver._thread.is_alive()
    assert receiver.stats["fetches"] == 1 and receiver.latest().version == 0  # ... which is never fetched
  finally:
    connection.close()
    server.shutdown()


def test_a_server_shutting_down_answers_the_long_polls_under_way_at_once():
  """A Flight server's shutdown waits for the calls under way: a sampler's long poll for a newer version would hold it
  for the poll's whole wait. The server ends every wait first: the poll answers with the newest version it holds."""
  server, _, _, store = make_server()
  connection = FlightConnection(server.address, timeout_s=60, retry_s=5)
  answered = []
  store.publish({"w": np.ones((4,), np.float32)}, 0)
  poll = threading.Thread(target=lambda: answered.append(
      connection.action(VersionQuery(min_version=1, wait_s=30.0), VersionInfo).version))
  poll.start()
  deadline = time.monotonic() + 30
  while server.counters["actions"] < 1 and time.monotonic() < deadline:  # the poll has reached the server
    time.sleep(0.01)
  server.shutdown()
  poll.join(60)
  assert answered == [0]
  later = threading.Thread(target=lambda: answered.append(store.wait_version(1, timeout=None)), daemon=True)
  later.start()  # a wait with no limit returns at once once waits are ended (it would never return before)
  later.join(60)
  assert answered == [0, 0]
  connection.close()


def test_a_call_retrying_against_a_trainer_gone_ends_when_its_session_does():
  """A heartbeat (or a weight poll) that began as the trainer shut down retries for the connection's whole limit
  (300 s by default), and the sampler's session waits for it; with the session's end as `abort` it ends at once."""
  connection = FlightConnection(f"127.0.0.1:{free_port()}", timeout_s=5)  # nothing listens there
  ended, raised = threading.Event(), []

  def beat():
    try:
      FlightControl(connection).heartbeat(Heartbeat(1), abort=ended)
    except ConnectionError as err:
      raised.append(str(err))
  beating = threading.Thread(target=beat, daemon=True)
  beating.start()
  deadline = time.monotonic() + 30
  while connection.counters.flight_retries < 1 and time.monotonic() < deadline:  # it is retrying
    time.sleep(0.01)
  ended.set()
  beating.join(60)
  assert raised == [f"a call to {connection.address} abandoned: the session it served has ended"]
  connection.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path):
  certs = write_test_certificates(tmp_path)
  server, controller, queue, _ = make_server(tls=TLSFiles(str(certs["server_cert"]), str(certs["server_key"]),
                                                          str(certs["ca"])))
  try:
    good = FlightConnection(server.address, tls=TLSFiles(str(certs["client_cert"]), str(certs["client_key"]),
                                                         str(certs["ca"])), timeout_s=10, retry_s=5)
    me = FlightControl(good).register(Register("s", SETTINGS)).sampler_id
    controller.published(Published(0))
    controller.lease(LeaseRequest(me, 0.0))
    FlightSampleSender(good, me).put(group_shard([3, 3], step=0, group=0))
    assert len(queue) == 2
    anonymous = flight.FlightClient(f"grpc+tls://{server.address}", tls_root_certs=certs["ca"].read_bytes())
    with pytest.raises(flight.FlightError):
      list(anonymous.do_action(flight.Action("control", b"{}"), options=flight.FlightCallOptions(timeout=5)))
    plain = flight.FlightClient(f"grpc+tcp://{server.address}")
    with pytest.raises(flight.FlightError):
      list(plain.do_action(flight.Action("control", b"{}"), options=flight.FlightCallOptions(timeout=5)))
    assert len(queue) == 2 and server.counters["actions"] == 1  # the good client's register alone
    (tmp_path / "other").mkdir()
    other = write_test_certificates(tmp_path / "other")  # a certificate of another CA: the handshake fails
    stranger = FlightConnection(server.address, tls=TLSFiles(str(other["client_cert"]), str(other["client_key"]),
                                                             str(certs["ca"])), timeout_s=2, retry_s=1)
    with pytest.raises(TrainerUnreachable, match="TLS handshake failed.*--tls-cert"):
      FlightControl(stranger).register(Register("s", SETTINGS))
  finally:
    server.shutdown()
  with pytest.raises(ValueError, match="needs all of"):
    TLSFiles.from_flags(str(certs["ca"]), None, None)
  with pytest.raises(FileNotFoundError, match="--tls-key"):
    TLSFiles(str(certs["ca"]), str(tmp_path / "nope.key"), str(certs["ca"])).read()


def test_an_unreachable_trainer_is_reported_after_the_retry_limit():
  server, _, _, _ = make_server()
  address = server.address
  server.shutdown()
  connection = FlightConnection(address, timeout_s=1, retry_s=0.5)
  start = time.monotonic()
  with pytest.raises(TrainerUnreachable, match=f"the trainer at {address} did not take the call"):
    FlightControl(connection).heartbeat(Heartbeat(0))
  assert time.monotonic() - start < 10
