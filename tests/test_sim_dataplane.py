"""The trainer's data plane in the simulator (issue 62): hand-worked bytes and seconds of both designs, the event
simulator against the analytic sweep, the distflow-scaling preset's results, and monotone properties."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax import cli
from streamrl_jax.sim.dataplane import (SimDataPlaneConfig, gather_seconds, gradient_seconds, leader_bytes,
                                        leader_seconds, processes, received_times, shard_broadcast_seconds)
from streamrl_jax.sim.pipeline import SimBatchConfig, simulate
from streamrl_jax.sim.presets import preset, scaling_preset
from streamrl_jax.sim.profiles import LengthDistribution
from streamrl_jax.sim.scaling import at_devices, iteration_parts, iteration_seconds, length_draws, sweep

CENTRAL, PER_PROCESS = SimDataPlaneConfig(design="central"), SimDataPlaneConfig(design="per_process")
# 1 GB/s everywhere, 1 byte a token, no latency: seconds are gigabytes
UNIT = dict(nic_gbs=1.0, fabric_gbs=1.0, host_copy_gbs=1.0, hop_latency_s=0.0, wire_bytes_per_token=1.0,
            wire_bytes_per_sample=0.0, broadcast_bytes_per_token=1.0, grad_bytes_per_param=1.0,
            control_bytes_per_sample=0.0)


def test_process_0_receives_the_whole_batch_centrally_and_its_own_shard_per_process():
  assert [processes(CENTRAL, d) for d in (1, 8, 9, 32, 1024)] == [1, 1, 2, 4, 128]
  # 100 samples of 10 tokens: 1,000 x 16.125 + 100 x 100 bytes on the wire; a version of 8 GB
  central = leader_bytes(CENTRAL, 100, 1000, 8e9, devices=32)
  assert central == {"samples_in": 26125.0, "weights_out": 8e9, "control": 4000.0}
  per_process = leader_bytes(PER_PROCESS, 100, 1000, 8e9, devices=32)
  assert per_process == {"samples_in": 26125.0 / 4, "weights_out": 2e9, "control": 4000.0}
  assert leader_bytes(PER_PROCESS, 100, 1000, 8e9, devices=8) == central  # one process: the same
  # process 0's busiest resource: the version out at 25 GB/s (0.32 s), above 1,000 tokens' decode
  assert leader_seconds(CENTRAL, 100, 1000, 8e9, 32) == pytest.approx((8e9 + 4000) / 25e9)
  assert leader_seconds(PER_PROCESS, 100, 1000, 8e9, 32) == pytest.approx((2e9 + 4000) / 25e9)


def test_the_collectives_and_copies_by_hand():
  central, per_process = SimDataPlaneConfig(design="central", **UNIT), SimDataPlaneConfig(design="per_process", **UNIT)
  # 1 GB of padded shards to 2 processes: host to device and back (2 s) and a ring all-reduce 2 x 1/2 (1 s)
  assert shard_broadcast_seconds(central, 1e9, shards=2, devices=16) == pytest.approx(3.0)
  assert shard_broadcast_seconds(dataclasses.replace(central, hop_latency_s=1e-3), 1e9, 2, 16) == pytest.approx(
      3.0 + 2 * 2 * 1 * 1e-3)  # two shards, each a ring of 2 (P - 1) hops
  assert shard_broadcast_seconds(central, 1e9, 2, devices=8) == 0.0  # one process: broadcast_one_to_all returns
  assert shard_broadcast_seconds(per_process, 1e9, 2, devices=16) == 0.0
  # 8e9 one-byte gradients, each of 8 devices a host reducing 1 GB over 4 hosts: 2 x 3/4 s, both designs
  assert gradient_seconds(central, 8e9, 32) == gradient_seconds(per_process, 8e9, 32) == pytest.approx(1.5)
  assert gradient_seconds(central, 8e9, 8) == 0.0
  # an 8 GB version: centrally 3/4 of it across to each device's link (0.75 s), then whole to the host (8 s);
  # per process a quarter each, from its 8 devices at once (0.25 s); one process: the same in both (1 s)
  assert gather_seconds(central, 8e9, 32) == pytest.approx(8.75)
  assert gather_seconds(per_process, 8e9, 32) == pytest.approx(0.25)
  assert gather_seconds(central, 8e9, 8) == gather_seconds(per_process, 8e9, 8) == pytest.approx(1.0)


def test_the_door_is_a_first_come_first_served_queue():
  plane = dataclasses.replace(CENTRAL, decode_tokens_per_s=1e6, nic_gbs=1e12, wire_bytes_per_sample=0.0)
  arrivals, tokens = np.array([10.0, 0.0, 0.0]), np.full(3, 1e6)  # a second of decode each
  np.testing.assert_allclose(received_times(plane, arrivals, tokens, devices=16), [11.0, 1.0, 2.0])
  per_process = dataclasses.replace(plane, design="per_process")  # 2 processes: half each
  np.testing.assert_allclose(received_times(per_process, arrivals, tokens, devices=16), [10.5, 0.5, 1.0])


@pytest.mark.parametrize("model", ["7b", "72b"])
def test_one_process_makes_the_designs_equal(model):
  draws = length_draws(scaling_preset(model))
  parts = [iteration_parts(at_devices(scaling_preset(model, data_plane=p), 8), draws) for p in (CENTRAL, PER_PROCESS)]
  assert parts[0] == parts[1]
  small = dict(lengths=LengthDistribution(median=100, sigma=0.5, max_len=300), total_devices=16, sampler_devices=8,
               batch=SimBatchConfig(global_batch=128), iterations=2)
  runs = [simulate(preset("paper-7b-5k", mode="stream", data_plane=p, **small)) for p in (CENTRAL, PER_PROCESS)]
  assert runs[0]["samples_per_s"] == runs[1]["samples_per_s"]


@pytest.mark.parametrize("decode, bound", [(2e7, "trainer_path"), (3e4, "process_0")])
def test_the_event_simulator_agrees_with_the_analytic_iteration(decode, bound):
  """Trainer-bound (short outputs, four samplers a trainer device): the event simulator's steady iteration (6
  iterations less 3) is the analytic one within 1%, central and per process, and with a slow decode process 0's
  queue bounds the central iteration in both."""
  for design in ("central", "per_process"):
    config = scaling_preset("7b", data_plane=SimDataPlaneConfig(design=design, decode_tokens_per_s=decode),
                            lengths=LengthDistribution(median=300, sigma=0.5, max_len=600), total_devices=96,
                            sampler_devices=64, batch=SimBatchConfig(global_batch=2048, micro_batch=128))
    total = [simulate(dataclasses.replace(config, iterations=n))["total_s"] for n in (3, 6)]
    seconds, got = iteration_seconds(iteration_parts(config, length_draws(config)))
    assert (total[1] - total[0]) / 3 == pytest.approx(seconds, rel=0.01)
    assert got == (bound if design == "central" else "trainer_path")


def test_the_distflow_scaling_preset_writes_the_contract(tmp_path, capsys):
  assert cli.main(["simulate", "--preset", "distflow-scaling", "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["preset"] == "distflow-scaling" and results["devices"] == [8, 16, 32, 64, 128, 256, 512, 1024]
  for design in ("per_process", "central"):
    by_model = results[f"{design}_scaling_1024_by_model"]
    assert set(by_model) == {"7b", "72b"} and results[f"{design}_scaling_1024"] == min(by_model.values())
    for key, model in results["models"].items():
      assert len(model[design]["samples_per_s_per_device"]) == 8 and model[design]["normalized"][0] == 1.0
      assert model[design]["normalized"][-1] == by_model[key]
  assert results["per_process_scaling_1024"] >= 0.85
  assert results["central_scaling_1024"] < results["per_process_scaling_1024"]
  assert all(results["central_saturation_devices_by_model"][k] > 1024 for k in ("7b", "72b"))
  assert (tmp_path / "scaling.png").stat().st_size > 1000
  out = capsys.readouterr().out
  assert "per_process" in out and "wrote" in out and "scaling.png" in out


@settings(max_examples=15, deadline=None)
@given(model=st.sampled_from(["7b", "72b"]), nic=st.floats(1.0, 100.0), fabric=st.floats(1.0, 100.0),
       copy=st.floats(1.0, 100.0), decode=st.floats(1e5, 1e8), latency=st.floats(0.0, 1e-3))
def test_central_throughput_per_device_never_rises_and_never_beats_per_process(model, nic, fabric, copy, decode,
                                                                              latency):
  plane = SimDataPlaneConfig(nic_gbs=nic, fabric_gbs=fabric, host_copy_gbs=copy, decode_tokens_per_s=decode,
                             hop_latency_s=latency)
  devices = (8, 16, 64, 256)
  runs = {d: sweep(scaling_preset(model, data_plane=dataclasses.replace(plane, design=d)), devices)
          for d in ("central", "per_process")}
  central = runs["central"]["samples_per_s_per_device"]
  assert all(b <= a * (1 + 1e-9) for a, b in zip(central, central[1:])), central
  assert all(c <= p * (1 + 1e-9) for c, p in zip(central, runs["per_process"]["samples_per_s_per_device"]))
  assert central[0] == runs["per_process"]["samples_per_s_per_device"][0]


def test_a_design_that_is_neither_is_refused():
  with pytest.raises(ValueError, match="design must be one of"):
    SimDataPlaneConfig(design="decentral")
  with pytest.raises(ValueError, match="unknown scaling model"):
    scaling_preset("32b")
