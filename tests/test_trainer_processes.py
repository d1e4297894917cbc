"""A trainer of several processes as real processes on loopback (`streamrl launch local --trainer-processes 2`):
each takes its own groups' samples at its own door and serves its own pieces of the weights; a process killed and
the run resumed trains every sample once. Its pure parts are tested in tests/test_trainer_doors.py; its Ctrl-C in
tests/test_programs.py, its pods' run against a single process in tests/test_gke.py."""

import json

import pytest

from tests.processes import finish, launch, metrics, write_config


@pytest.mark.slow
def test_a_trainer_process_killed_and_the_run_resumed_trains_each_sample_once(tmp_path):
  """A trainer of two processes, each taking its own groups' samples at its own door: process 1 is killed (SIGKILL)
  right after step 3's metrics row, before that step's checkpoint; the launcher stops the run, and a resume trains
  steps 3 to 5 again, each sample once, each process taking half of them."""
  config = write_config(tmp_path / "two.gin", steps=5, trainer_devices=2, mode="stream")
  killed = {"STREAMRL_FAULT": "row@3=sigkill", "STREAMRL_FAULT_PROCESS": "1"}
  code, out = finish(launch(tmp_path, "--trainer-processes", "2", "--config", config, env=killed), tmp_path)
  assert code != 0 and "trainer-1 exited with code -9" in out, out[-3000:]
  assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
  code, out = finish(launch(tmp_path, "--trainer-processes", "2", "--config", config, "--resume"), tmp_path)
  assert code == 0, out[-3000:]
  assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4, 5]
  # the resumed segment's counters: whether the killed run's process 0 recorded its own end before the launcher
  # stopped it (its counters then count step 3, trained again here) is a race this test does not judge
  *killed_run, segment = json.loads((tmp_path / "run.json").read_text())["segments"]
  assert len(killed_run) == 1 and killed_run[0]["last_step"] == 3
  counters = segment["counters"]
  resumed = 3 * 8  # steps 3..5 of 4 prompts x 2 samples, from the checkpoint of step 2
  assert counters["samples_trained"] == counters["unique_samples_trained"] == counters["samples_planned"] == resumed
  assert counters["duplicate_samples"] == counters["refused_samples"] == 0
  assert counters["flight_accepted_samples"] == counters["intake_local_samples"] == resumed // 2
  assert counters["intake_weight_kib/1"] > 0  # process 1 served its own pieces of the weights
