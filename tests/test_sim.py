"""The simulator: closed-form cases, monotonic properties, determinism, errors, and the CLI's output."""

import dataclasses
import json

import numpy as np
import pytest

from streamrl_jax import cli
from streamrl_jax.sim.dataplane import SimDataPlaneConfig
from streamrl_jax.sim.instance import simulate_instance
from streamrl_jax.sim.pipeline import SimBatchConfig, SimConfig, SimSyncConfig, SimTrainerConfig, simulate
from streamrl_jax.sim.presets import expected_generation_s, preset
from streamrl_jax.sim.profiles import H800, QWEN25, Hardware, LengthDistribution, memory_max_batch

PTL = {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04}


def test_one_instance_with_fixed_lengths_has_the_exact_makespan():
  ptl = lambda n: PTL[n]  # noqa: E731
  # batch 4 >= 3 samples of 10 tokens: 3 prefills, then 10 steps at PTL(3)
  np.testing.assert_allclose(simulate_instance([10, 10, 10], 4, ptl, prefill_s=0.5), 1.5 + 10 * 0.03)
  # batch 1: strictly one after another
  np.testing.assert_allclose(simulate_instance([10, 20], 1, ptl, prefill_s=0.5), [0.6, 0.6 + 0.5 + 0.2])
  # batch 2, lengths 5 and 10: 5 steps at PTL(2), then 5 at PTL(1); a third sample is admitted at step 5
  finish = simulate_instance([5, 10, 5], 2, ptl)
  np.testing.assert_allclose(finish, [5 * 0.02, 5 * 0.02 + 5 * 0.02, 5 * 0.02 + 5 * 0.02])


def small(**overrides) -> SimConfig:
  fields = dict(model=QWEN25["7b"], lengths=LengthDistribution(median=500, sigma=0.8, max_len=4000),
                total_devices=16, sampler_devices=8, tensor_parallel=1, batch=SimBatchConfig(global_batch=256),
                iterations=3)
  fields.update(overrides)
  return SimConfig(**fields)


def test_infinitely_fast_trainer_makes_async_run_at_generation_speed():
  config = small(mode="async", trainer=SimTrainerConfig(mfu=1e12, optimizer_step_s=0.0),
                 sync=SimSyncConfig(latency_s=0.0, bandwidth_gbs=1e12),
                 data_plane=SimDataPlaneConfig(nic_gbs=1e12, fabric_gbs=1e12, host_copy_gbs=1e12,
                                               decode_tokens_per_s=1e18))
  result = simulate(config)
  np.testing.assert_allclose(result["iteration_s"], result["generation_s"], rtol=1e-6)


def test_modes_order_and_determinism():
  runs = {m: simulate(small(mode=m, dispatch="skew_aware")) for m in ("disaggregated", "stream", "async")}
  assert runs["disaggregated"]["samples_per_s"] < runs["stream"]["samples_per_s"] < runs["async"]["samples_per_s"]
  again = simulate(small(mode="async", dispatch="skew_aware"))
  assert again["samples_per_s"] == runs["async"]["samples_per_s"]
  assert simulate(small(mode="async", seed=1))["samples_per_s"] != runs["async"]["samples_per_s"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_sampler_devices_never_slow_generation(seed):
  config = preset("paper-32b-10k", dispatch="random", seed=seed)
  times = [expected_generation_s(config, s, samples=1) for s in (4, 8, 16, 32, 48, 60)]
  assert all(b <= a for a, b in zip(times, times[1:])), times


def test_async_staleness_zero_equals_stream():
  a = simulate(small(mode="async", staleness=0))
  s = simulate(small(mode="stream"))
  np.testing.assert_allclose(a["samples_per_s"], s["samples_per_s"], rtol=1e-9)


def test_inconsistent_inputs_are_refused():
  with pytest.raises(ValueError, match="not even one sequence"):
    memory_max_batch(QWEN25["72b"], H800, 1, 4000)
  with pytest.raises(ValueError, match="sync bandwidth"):
    small(sync=SimSyncConfig(bandwidth_gbs=-1.0))
  with pytest.raises(ValueError, match="sampler_devices=16 must leave devices"):
    small(sampler_devices=16)
  with pytest.raises(ValueError, match="unknown mode"):
    small(mode="pipelined")
  with pytest.raises(ValueError, match="bf16_tflops"):
    Hardware("X", 0.0, 80, 3, 1)
  with pytest.raises(ValueError, match="unknown preset"):
    preset("paper-1t")


def test_a_field_that_moved_into_a_part_is_refused_naming_its_new_place():
  with pytest.raises(ValueError, match=r"SimConfig.train_mfu moved: set SimTrainerConfig.mfu instead"):
    preset("local-cpu", train_mfu=0.3)
  with pytest.raises(ValueError, match=r"SimConfig.global_batch moved: set SimBatchConfig.global_batch instead"):
    preset("paper-7b-5k", global_batch=64)
  assert preset("paper-7b-5k", batch=SimBatchConfig(global_batch=64)).batch.global_batch == 64


def test_simulate_command_writes_results_and_plots(tmp_path, capsys):
  assert cli.main(["simulate", "--preset", "paper-72b-20k", "--out", str(tmp_path), "--iterations", "2"]) == 0
  results = json.loads((tmp_path / "results.json").read_text())
  ladder = results["normalized_throughput"]
  assert set(ladder) == {"colocated", "skew_aware", "disaggregated_stream", "async"} and ladder["colocated"] == 1.0
  assert ladder["async"] > ladder["disaggregated_stream"] > ladder["colocated"]
  for name in ("throughput_by_mode.png", "gantt.png", "generation_normalized.png"):
    assert (tmp_path / name).stat().st_size > 1000
  assert "normalized throughput" in capsys.readouterr().out


def test_empirical_length_lists_are_used():
  lengths = LengthDistribution(empirical=(10, 20, 30), max_len=25)
  draws = lengths.sample(np.random.default_rng(0), 100)
  assert set(draws.tolist()) <= {10, 20, 25}
  assert dataclasses.replace(lengths, max_len=40).sample(np.random.default_rng(0), 100).max() == 30


@pytest.mark.parametrize("train_mfu, direction", [(50.0, 1), (0.001, -1)])
def test_elastic_policy_follows_the_bottleneck(train_mfu, direction):
  from streamrl_jax.sim.pipeline import simulate_elastic
  config = small(mode="disaggregated", trainer=SimTrainerConfig(mfu=train_mfu), iterations=4,
                 batch=SimBatchConfig(global_batch=256, length_drift=0.1))
  devices = simulate_elastic(config)["sampler_devices_by_iteration"]
  steps = np.diff(devices)
  assert set(steps.tolist()) <= {-1, 0, 1} and 1 <= min(devices) and max(devices) <= 15
  assert steps[0] == direction


def test_local_cpu_preset_uses_the_measured_curve():
  config = preset("local-cpu")
  assert dict(config.sampler.ptl_curve)[32] == pytest.approx(17.8e-3) and config.sampler.max_batch == 32
  assert simulate(config)["samples_per_s"] > 0
