"""A trainer of several processes without a central data node, in its pure parts: each group's owner, the doors
that take only their own groups, the rows' descriptions the processes share (never the tokens), the shared view
and its shards, a call's rows laid out on their owners' devices, packing by owner, a sampler's routing, the
`Delivery` a door sends process 0. The processes themselves run in tests/test_gke.py and tests/test_trainer_processes.py."""

import dataclasses
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import Delivery, DeliveryStatus, LeaseRequest, Published, Register, Registered
from streamrl_jax.pipeline.sampler.routing import RoutedSender
from streamrl_jax.pipeline.step_plan import group_owner
from streamrl_jax.pipeline.trainer.intake import describe, read_description, shared_view, split_by_step
from streamrl_jax.streaming import SampleShard
from streamrl_jax.training.owned_rows import BatchNotSplit, owned_layout, process_rows
from streamrl_jax.training.packing import pack_plan
from tests.flight_setup import SETTINGS, leased_sender, make_server
from tests.wire_samples import group_shard


def shard_of(groups, step=3, seed=0, lengths=(5, 7)) -> SampleShard:
  return SampleShard.concat([group_shard(list(lengths), step=step, seed=seed + g, group=g) for g in groups])


def test_groups_are_dealt_round_the_processes():
  assert [group_owner(g, 3) for g in range(7)] == [0, 1, 2, 0, 1, 2, 0]
  assert {group_owner(g, 1) for g in range(5)} == {0}


def test_token_stats_are_what_the_tokens_say():
  """trained tokens, their versions' sum and least, the environment's tokens: against numpy on the tokens."""
  shard = shard_of([0, 1], lengths=(2, 5, 9))
  mask = shard.loss_mask
  np.testing.assert_array_equal(shard.stats[:, 0], mask.sum(1))
  np.testing.assert_array_equal(shard.stats[:, 1], (shard.versions * mask).sum(1))
  step = 6
  stale = step - shard.versions[mask]
  assert shard.staleness_sum_max(step) == (mask.sum(), stale.sum(), stale.max())
  hole = mask & (np.arange(mask.shape[1]) != 3)  # an environment's token inside the completion
  agent = dataclasses.replace(shard, loss_mask=hole)  # counted afresh from the new mask
  env = sum(int(np.sum(agent.valid[i, np.argmax(hole[i]):] & ~hole[i, np.argmax(hole[i]):]))
            for i in range(len(hole)) if hole[i].any())
  assert agent.env_tokens == env > 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6), st.integers(0, 3), st.integers(1, 3))
def test_a_description_holds_every_row_field_and_no_token(lengths, seed, functions):
  shard = SampleShard.concat([group_shard(lengths, step=2, seed=seed, group=g, functions=functions) for g in (4, 9)])
  rows = read_description(describe(shard, process=1), functions)
  for name in ("group_ids", "sample_indices", "steps", "first_versions", "last_versions", "reward_errors",
               "reward_timeouts", "rewards", "reward_parts"):
    np.testing.assert_array_equal(rows[name], getattr(shard, name), err_msg=name)
  np.testing.assert_array_equal(rows["token_stats"], shard.stats)
  np.testing.assert_array_equal(rows["lengths"], shard.valid.sum(1))
  assert set(rows["owners"]) == {1}
  other_tokens = dataclasses.replace(shard, tokens=(shard.tokens + 1) * shard.valid, logprobs=shard.logprobs / 2)
  np.testing.assert_array_equal(describe(other_tokens, 1), describe(shard, 1))  # the tokens stay where they arrived


def test_the_shared_view_holds_every_row_and_only_its_own_tokens():
  mine, theirs = shard_of([0, 2], seed=1), shard_of([1, 3], seed=2, lengths=(4, 11))
  rows = [read_description(describe(mine, 0), 1), read_description(describe(theirs, 1), 1)]
  view = shared_view(rows, mine, process=0)
  assert sorted(view.keys()) == sorted(mine.keys() + theirs.keys())
  assert view.owners.tolist() == [0, 1] * 4  # interleaved: a call holds rows of both processes
  for i, key in enumerate(view.keys()):
    own = view.owners[i] == 0
    source = mine if own else theirs
    j = source.keys().index(key)
    np.testing.assert_array_equal(view.stats[i], source.stats[j])
    assert view.valid[i].sum() == source.valid[j].sum()
    expected = np.zeros(view.tokens.shape[1], np.int32)
    if own:
      expected[:source.valid[j].sum()] = source.tokens[j, :source.valid[j].sum()]
    np.testing.assert_array_equal(view.tokens[i], expected)
  assert view.trained_tokens == mine.trained_tokens + theirs.trained_tokens


def test_the_view_splits_by_step_and_where_a_sample_comes_again():
  a, b, again = shard_of([0], step=3), shard_of([1], step=4), shard_of([0], step=3, seed=9)
  rows = [read_description(describe(SampleShard.concat([a, b, again]), 0), 1)]
  parts = split_by_step(shared_view(rows, SampleShard.concat([a, b, again]), 0))
  assert [sorted(set(p.steps.tolist())) for p in parts] == [[3], [3], [4]]
  assert all(len(set(p.keys())) == p.num_samples for p in parts)  # a shard never holds a sample twice
  assert sum(p.num_samples for p in parts) == 6


@dataclasses.dataclass(frozen=True)
class Device:
  id: int
  process_index: int


class FakeSharding:
  """Rows of a global batch split evenly over `devices`, `per_process` devices a process."""

  def __init__(self, devices: int, per_process: int):
    self.devices = [Device(d, d // per_process) for d in range(devices)]

  def devices_indices_map(self, shape):
    size = shape[0] // len(self.devices)
    return {d: (slice(i * size, (i + 1) * size), slice(None)) for i, d in enumerate(self.devices)}


def test_a_calls_rows_lie_on_their_owners_devices():
  owners = np.asarray([0, 1, 1, 1, 0, 1])
  valid = np.ones((6, 3), bool)
  valid[4] = False  # a row without tokens is left out
  values = {"tokens": np.arange(18).reshape(6, 3) + 1, "valid": valid}
  out, shape = owned_layout(values, owners, 4, lambda n: max(4, 1 << (n - 1).bit_length()),
                            lambda shape: FakeSharding(4, 2), processes=2)
  assert shape == (8, 4)  # 3 rows of process 1 need 4 slots each side
  slots = process_rows(FakeSharding(4, 2), shape, 2)
  assert [s.tolist() for s in slots] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  np.testing.assert_array_equal(out["tokens"][0, :3], values["tokens"][0])  # process 0: rows 0 (and not 4)
  assert not out["tokens"][1:4].any()
  np.testing.assert_array_equal(out["tokens"][4:7, :3], values["tokens"][[1, 2, 3]])
  np.testing.assert_array_equal(out["tokens"][7, :3], values["tokens"][5])


def test_a_mesh_that_does_not_split_the_batch_across_processes_is_refused():
  class Replicated(FakeSharding):
    def devices_indices_map(self, shape):
      return {d: (slice(None), slice(None)) for d in self.devices}
  with pytest.raises(BatchNotSplit, match="split across them"):
    owned_layout({"valid": np.ones((2, 2), bool)}, np.asarray([0, 1]), 2, lambda n: n,
                 lambda shape: Replicated(2, 1), processes=2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 2)), min_size=1, max_size=12))
def test_a_packed_row_holds_one_owners_samples(samples):
  lengths, owners = zip(*samples)
  valid = np.arange(8)[None] < np.asarray(lengths)[:, None]
  plan = pack_plan(valid, 8, np.asarray(owners))
  assert sorted(r for spans in plan for r, _, _ in spans) == list(range(len(samples)))
  assert all(len({owners[r] for r, _, _ in spans}) == 1 for spans in plan)
  assert all(sum(c for _, _, c in spans) <= 8 for spans in plan)


def test_a_sampler_sends_each_group_to_its_owners_door():
  sent = {0: [], 1: []}

  class Door:
    def __init__(self, k):
      self.k, self.sampler_id, self.stats = k, 5, dict(put_samples=0)

    def put(self, shard, timeout=None):
      sent[self.k].append(sorted(set(shard.group_ids.tolist())))
      self.stats["put_samples"] += shard.num_samples
  routed = RoutedSender(None, lambda address: None)
  routed.senders = [Door(0), Door(1)]  # process 0's door, and process 1's
  routed.put(shard_of([4, 5, 7]))
  routed.put(shard_of([2]))
  assert sent == {0: [[4], [2]], 1: [[5, 7]]}
  assert routed.stats["put_samples/1"] == 4 and routed.stats["put_samples"] == 8


def test_a_door_takes_its_own_groups_alone():
  server, controller, queue, _ = make_server(owner=(1, 2))
  try:
    from streamrl_jax.streaming.flight_client import FlightConnection
    connection = FlightConnection(server.address, timeout_s=10, retry_s=5)
    sender = leased_sender(connection, controller)
    from streamrl_jax.messages import BadMessage
    with pytest.raises(BadMessage, match="group 0 belongs to trainer process 0; this is process 1 of 2"):
      sender.put(SampleShard.concat([group_shard([3, 4], step=0, group=g) for g in (1, 0)]))
    sender.put(SampleShard.concat([group_shard([3, 4], step=0, group=g) for g in (1, 3)]))
    assert queue.get(timeout=5).group_ids.tolist() == [1, 1, 3, 3]
    assert server.counters["accepted_bytes"] > 0
    connection.close()
  finally:
    server.shutdown()


def test_process_0_judges_a_delivery_as_the_batch_itself():
  _, controller, _, _ = make_server()
  sampler = controller.register(Register("s", SETTINGS)).sampler_id
  controller.published(Published(0))
  assert controller.lease(LeaseRequest(sampler, 0.0)).lease.group_ids == (0, 1, 2, 3)
  assert controller.door.deliver(Delivery(sampler, 0, (1, 3), (4.0, 2.0))) == DeliveryStatus("accept")
  refused = controller.door.deliver(Delivery(sampler, 1, (9,), (4.0,)))
  assert refused.status == "refused" and "group 9 of step 2 was never leased" in refused.reason
  assert controller.door.deliver(Delivery(12345, 0, (0,), (1.0,))).status == "rejoin"


def test_the_doors_travel_in_control_messages():
  for message in (Delivery(3, 1, (4, 6), (2.5, 7.0)), DeliveryStatus("refused", "why"),
                  Registered(1, 0, 4, 0.5, ("", "host-1:4431"))):
    assert decode_message(encode_message(message)) == message


def test_a_version_comes_in_pieces_from_every_process_and_is_handed_whole_to_a_relay():
  """A version whose arrays are sharded over two devices, as two trainer processes would hold it: each door serves
  its own pieces only; the sampler assembles whole arrays (a scalar and a replicated array included), its relay then
  serves the whole version to a child."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from streamrl_jax.streaming.flight_client import FlightConnection, fetch_weights
  from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
  from streamrl_jax.streaming.weight_pieces import BadPieces, assemble, own_pieces
  from streamrl_jax.streaming.weight_relay import RelayServer, RelayStore

  mesh = Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))
  rng = np.random.default_rng(0)
  host = {"w": rng.standard_normal((6, 4)).astype(np.float32), "b": np.arange(3, dtype=np.float32),
          "step": np.float32(7)}
  tree = {"w": jax.device_put(host["w"], NamedSharding(mesh, PartitionSpec("fsdp"))),
          "b": jax.device_put(host["b"], NamedSharding(mesh, PartitionSpec())),
          "step": jax.device_put(host["step"], NamedSharding(mesh, PartitionSpec()))}
  pieces, where = own_pieces(tree)
  assert sorted(where[p][0] for p in pieces) == ["['b']", "['step']", "['w']", "['w']"]  # one holder per slice
  # of 2 processes, each holding a replica of b and step: process 1 serves the second array in order, step
  assert sorted(where[p][0] for p in own_pieces(tree, 1, 2)[0]) == ["['step']", "['w']", "['w']"]
  first = {p for p in pieces if where[p][2][:1] in ([], [0])}  # process "0": the first half of w, b and step
  stores, servers = [HostWeightStore(pieces=True) for _ in range(2)], []
  for store, mine in zip(stores, (first, set(pieces) - first)):
    store._store({p: pieces[p] for p in sorted(mine)}, 1, 0.0, {p: where[p] for p in mine})
    servers.append(TrainerFlightServer("127.0.0.1", 0, controller=None, samples=None, weights=store,
                                       limits=ServerLimits(1, chunk_bytes=16)))
  connections = [FlightConnection(s.address, timeout_s=10, retry_s=5) for s in servers]
  relay = RelayServer("127.0.0.1", 0, RelayStore(begin_wait_s=5))
  try:
    expected = {f"['{k}']": np.shape(v) for k, v in host.items()}
    version, flat, nbytes = fetch_weights(connections[0], 1, expected, streams=2, sink=relay.store,
                                          doors=(connections[1],))
    assert version == 1 and nbytes == sum(p.nbytes for p in pieces.values())
    for name, value in host.items():
      np.testing.assert_array_equal(flat[f"['{name}']"], value)
    with pytest.raises(BadPieces, match="pieces of 12 elements arrived for 24"):  # one process's pieces alone
      assemble({p: pieces[p] for p in first}, where)
    child = FlightConnection(relay.address, timeout_s=10, retry_s=5)
    _, again, _ = fetch_weights(child, 1, expected, streams=2)
    np.testing.assert_array_equal(again["['w']"], host["w"])
    child.close()
  finally:
    for connection in connections:
      connection.close()
    for server in servers + [relay]:
      server.shutdown()


def test_the_intake_of_one_process_hands_back_what_arrived_and_its_stop_does_not_raise_there():
  """The intake's poll (its all-gathers) in a cluster of one: the shards come back whole, one step at a time, and
  process 0's stop only tells the others."""
  from streamrl_jax.pipeline.trainer.intake import ProcessIntake
  from streamrl_jax.streaming import SampleQueue

  queue = SampleQueue(64)
  shards = [shard_of([0, 1], step=2), shard_of([2], step=3, lengths=(3, 9))]
  for shard in shards:
    queue.put(shard)
  intake = ProcessIntake(queue, reward_functions=1, door_bytes=lambda: (5 << 10, 7 << 10), poll_s=0.01)
  got = [intake.get(timeout=0.05), intake.get(timeout=0.05)]
  with pytest.raises(TimeoutError):
    intake.get(timeout=0.02)
  for want, have in zip(shards, got):
    assert have.keys() == want.keys()
    np.testing.assert_array_equal(have.tokens, want.tokens[:, :have.tokens.shape[1]])
    np.testing.assert_array_equal(have.stats, want.stats)
  assert intake.row()["intake_samples"] == 6 and intake.row()["intake_door_kib/0"] == 5
  assert intake.row()["intake_weight_kib/0"] == 7 and intake.row()["intake_peer_description_bytes"] == 0
  intake.stop()  # no other process to tell; process 0 goes on to raise what stopped it


def test_a_role_mesh_that_leaves_a_process_no_device_is_refused_by_its_key():
  from streamrl_jax.meshes import MeshConfig, role_mesh
  devices = [Device(0, 0), Device(1, 1)]  # one device a process, two processes
  with pytest.raises(ValueError, match="MeshConfig.trainer_devices=1 leaves trainer process 1 no device"):
    role_mesh(MeshConfig(trainer_devices=1), "trainer", devices)
