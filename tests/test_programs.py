"""`streamrl launch local`, `streamrl trainer` and `streamrl sampler` as real processes on loopback: a run, a
clean Ctrl-C with no orphan and a resume; and the pure parts (core assignment, the role's cluster from flags
or environment). A trainer of two processes with two samplers runs in tests/test_gke.py, from the rendered
GKE manifests, and is compared with this module's single-process run."""

import json
import os
import signal
import time

import pytest

from streamrl_jax import distributed
from streamrl_jax.commands.launch_local import assign_cores
from tests.processes import TIMEOUT_S, alive, children_of, finish, launch, metrics, write_config


@pytest.mark.slow
def test_launch_local_runs_the_job_across_processes(single_process_run):
  workdir, out = single_process_run
  assert [m["step"] for m in metrics(workdir)] == [1, 2]
  summary = json.loads((workdir / "summary.json").read_text())
  counters = summary["counters"]
  assert counters["samples_trained"] == counters["samples_generated"] == counters["flight_accepted_samples"] == 16
  assert counters["prompts_submitted"] == 8 and counters["duplicate_samples"] == 0
  for name in ("timeline.png", "trace.json", "final_model/config.json", "checkpoints", "logs/sampler-0.log"):
    assert (workdir / name).exists(), name
  lanes = {e["args"]["name"] for e in json.loads((workdir / "trace.json").read_text())["traceEvents"] if e["ph"] == "M"}
  assert {"sampler-0", "trainer", "sync"} <= lanes
  launched = json.loads((workdir / "launch.json").read_text())
  assert [c["cores"] for c in launched] == assign_cores(sorted(os.sched_getaffinity(0)), 1, 1)  # --pin-cores
  assert not any(alive(c["pid"]) for c in launched)
  assert "the run is over" in (workdir / "logs" / "sampler-0.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_stops_every_process_and_the_run_resumes(tmp_path, processes):
  """Ctrl-C to the launcher while the trainer stands right after step 2's metrics row, before its checkpoint
  (held there by a fault point until the signal comes): the trainer finishes the step's checkpoint and says
  so, every process exits, and a resume trains the rest with each step once. A trainer of two processes stops
  with its process 0 (the others hear it at their next poll)."""
  config = write_config(tmp_path / "tiny.gin", steps=6, mode="async", trainer_devices=processes)
  paused, trainer = tmp_path / "paused", ("--trainer-processes", str(processes))
  proc = launch(tmp_path, "--config", config, *trainer,
                env={"STREAMRL_FAULT": "row@2=pause", "STREAMRL_FAULT_FILE": str(paused)})
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not paused.exists():
      assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
      time.sleep(0.2)
    pids = children_of(tmp_path)
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc, tmp_path, timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert code == 130, out
  assert "streamrl trainer: stopped; the checkpoint of step 2 is in" in out, out
  assert not any(alive(pid) for pid in pids)
  assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
  code, out = finish(launch(tmp_path, "--config", config, *trainer, "--resume"), tmp_path)
  assert code == 0, out
  assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 7))  # every step once, none twice


def test_assign_cores():
  assert assign_cores([0, 1], 1, 1) == [[0], [1]]
  assert assign_cores([0, 1, 2, 3, 4, 5], 1, 2) == [[0, 1, 2], [3, 4], [5]]
  assert assign_cores(list(range(8)), 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert assign_cores(list(range(5)), 1, 3) == [[0, 1], [2], [3], [4]]
  with pytest.raises(ValueError, match="needs a core per process: 3 processes, 2 cores"):
    assign_cores([0, 1], 1, 2)


def test_the_roles_cluster_comes_from_flags_or_the_environment():
  assert distributed.detect(env={}) is None
  assert distributed.detect("h:1", 2, 1, env={}) == distributed.DistributedConfig("h:1", 2, 1)
  with pytest.raises(ValueError, match="go together"):
    distributed.detect("h:1", None, 1, env={})
  assert distributed.detect(env={"STREAMRL_COORDINATOR": "c:9", "STREAMRL_NUM_PROCESSES": "4",
                                 "STREAMRL_PROCESS_ID": "3"}) == distributed.DistributedConfig("c:9", 4, 3)
  jobset = {"JOBSET_NAME": "rl", "REPLICATED_JOB_NAME": "trainer", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "2",
            "STREAMRL_NUM_PROCESSES": "4"}
  assert distributed.detect(env=jobset) == distributed.DistributedConfig("rl-trainer-0-0.rl:8476", 4, 2)
  tpu = {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "1", "STREAMRL_COORDINATOR_PORT": "1234"}
  assert distributed.detect(env=tpu) == distributed.DistributedConfig("t0:1234", 4, 1)
  assert distributed.detect(env={"TPU_WORKER_HOSTNAMES": "t0", "TPU_WORKER_ID": "0"}) is None
  with pytest.raises(ValueError, match="process id 4 of 4"):
    distributed.DistributedConfig("h:1", 4, 4)
  with pytest.raises(ValueError, match="not STREAMRL_PROCESS_ID"):
    distributed.detect(env={"STREAMRL_COORDINATOR": "c:9", "STREAMRL_NUM_PROCESSES": "4"})



@pytest.mark.slow
def test_in_flight_with_dynamic_sampling_across_processes(tmp_path):
  """Async in flight with dynamic sampling as programs: backfilled groups pass the trainer's door, every step
  ends, no group with equal rewards is trained (the untrained tiny model earns 0 everywhere: every group is
  filtered, the backfill bound is reached and the steps make no update)."""
  config = write_config(tmp_path / "tiny.gin", steps=3, mode="async")
  code, out = finish(launch(tmp_path, "--config", config, "--set", "SamplerConfig.in_flight=True",
                            "--set", "ControllerConfig.dynamic_sampling=True", "--set", "ControllerConfig.backfill_limit=2"),
                     tmp_path)
  assert code == 0, out
  steps = metrics(tmp_path)
  assert [m["step"] for m in steps] == [1, 2, 3]
  for m in steps:
    assert m["equal_reward_groups_trained"] == 0 and m["prompts_leased"] == 4 + m["groups_backfilled"]
    assert m["groups_filtered"] == 4 + 2 and m["groups_backfilled"] == 2 and m["update_skipped"] == 1.0
  counters = json.loads((tmp_path / "summary.json").read_text())["counters"]
  assert counters["flight_accepted_samples"] == 3 * 6 * 2 and counters["samples_trained"] == 0
  assert counters["prompts_backfilled"] == 6 and counters["refused_batches"] == 0
