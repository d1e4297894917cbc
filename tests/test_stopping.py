"""A stop is a request honoured at a step boundary: the signal rules, fault points, a waiting step abandoned
after its grace, and `streamrl train` stopped (Ctrl-C) or killed (SIGKILL) at each named point of a step, each
followed by a resume, ending with every step trained and logged once."""

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from streamrl_jax.faults import Fault, FaultPoints, parse_faults
from streamrl_jax.pipeline.watchdog import STALL_EXIT_CODE, StallWatch
from streamrl_jax.pipeline.trainer.worker import SHARD_POLL_S, TrainerWorker
from streamrl_jax.stopping import RunStopped, StopRequest
from tests.processes import finish, metrics, train, write_config
from tests.tensorboard_events import scalar_steps


def test_the_first_signal_in_a_deferred_region_is_a_request_and_the_second_stops_at_once():
  said = []
  stop = StopRequest(log=said.append)
  before = signal.getsignal(signal.SIGINT)
  with stop.installed():
    with pytest.raises(KeyboardInterrupt):  # outside deferred(): nothing to finish, at once
      signal.raise_signal(signal.SIGINT)
    assert not stop.requested
    with stop.deferred("step 3"):
      signal.raise_signal(signal.SIGTERM)
      assert stop.requested and stop.event.is_set() and stop.signals == 2
      assert said == ["SIGTERM: stopping after step 3 (press Ctrl-C again to stop at once)"]
      with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is not stop._on_signal


def test_a_request_is_overdue_only_after_its_grace():
  now = [100.0]
  stop = StopRequest(clock=lambda: now[0])
  assert not stop.overdue(5.0)
  stop.request()
  now[0] += 5.0
  assert not stop.overdue(5.0)
  now[0] += 0.1
  assert stop.overdue(5.0)
  stop.event.set()  # a loop sharing the event may set it: that is no request
  assert StopRequest().requested is False


def test_faults_are_parsed_by_name_and_refused_by_entry():
  assert parse_faults("") == ()
  assert parse_faults("row@1=sigint, save@12=pause") == (Fault("row", 1, "sigint"), Fault("save", 12, "pause"))
  for bad in ("row@0=sigint", "rows@1=sigint", "row@1=sigstop", "row=sigint", "row@x=sigkill"):
    with pytest.raises(ValueError, match="STREAMRL_FAULT: .* is not POINT@STEP=ACTION"):
      parse_faults(bad)


def test_a_pause_waits_for_a_signal_and_a_fault_fires_only_at_its_point(tmp_path):
  stop = StopRequest()
  mark = tmp_path / "paused"
  points = FaultPoints(parse_faults("row@2=pause"), stop, str(mark))
  points.hit("row", 1)
  points.hit("save", 2)
  assert not mark.exists()
  with stop.installed(), stop.deferred():
    ctrl_c = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))  # the pause returns on it, however late
    ctrl_c.start()
    points.hit("row", 2)
    ctrl_c.join()
  assert mark.read_text() == "row@2" and stop.requested


def test_a_hold_waits_until_its_file_is_removed_and_then_goes_on(tmp_path):
  mark = tmp_path / "holding"
  points = FaultPoints(parse_faults("row@3=hold"), StopRequest(), str(mark))
  held = threading.Thread(target=points.hit, args=("row", 3))
  held.start()
  deadline = time.monotonic() + 30
  while not mark.exists() and time.monotonic() < deadline:  # it stands at row@3
    time.sleep(0.01)
  assert mark.read_text() == "row@3" and held.is_alive()  # waiting: only the file's removal lets it go on
  mark.unlink()
  held.join(30)
  assert not held.is_alive()
  with pytest.raises(ValueError, match="'row@3=hold' waits on a file: set STREAMRL_FAULT_FILE"):
    FaultPoints(parse_faults("row@3=hold"), StopRequest(), "")


def test_a_step_still_waiting_after_the_grace_is_abandoned_and_not_before():
  now = [0.0]
  stop = StopRequest(clock=lambda: now[0])
  worker = SimpleNamespace(stop=stop, config=SimpleNamespace(wait=SimpleNamespace(stop_grace_s=10.0)),  # TrainerConfig
                           checkpointer=None, _progress=lambda what: None)
  worker._stopped = lambda abandoned_step=None: TrainerWorker._stopped(worker, abandoned_step)
  calls = []

  def nothing_yet(timeout):
    calls.append(timeout)
    now[0] += timeout
    if len(calls) == 3:
      stop.request()
    raise TimeoutError
  with pytest.raises(RunStopped) as stopped:
    TrainerWorker._next_shard(worker, nothing_yet, 6)
  assert stopped.value.abandoned_step == 7 and stopped.value.saved_step is None
  assert len(calls) == 3 + int(10.0 // SHARD_POLL_S) + 1  # 10 s of grace after the request, then one more poll
  worker.stop = None  # without a stop request it waits on
  calls.clear()
  feed = iter([TimeoutError, TimeoutError, "shard"])

  def later(timeout):
    item = next(feed)
    if item is TimeoutError:
      raise TimeoutError
    return item
  assert TrainerWorker._next_shard(worker, later, 0) == "shard"


# (fault, the exit code it leads to): Ctrl-C and SIGKILL at each point of a step, in a chain of resumes.
CHAIN = (("row@1=sigint", 130), ("row@2=sigkill", -9), ("publish@2=sigint", 130), ("publish@3=sigkill", -9),
         ("save@3=sigint", 130), ("save@4=sigkill", -9))


@pytest.mark.slow
def test_a_run_stopped_or_killed_at_every_point_resumes_with_every_step_once(tmp_path):
  config = write_config(tmp_path / "tiny.gin", steps=5, mode="async")
  workdir = tmp_path / "run"
  for i, (fault, expected) in enumerate(CHAIN):
    code, out = finish(train(workdir, "--config", config, *(["--resume"] if i else []), env={"STREAMRL_FAULT": fault}),
                       workdir, timeout=180)
    assert code == expected, f"{fault}: exit {code}\n{out}"
    steps = [m["step"] for m in metrics(workdir)]
    point, step = fault.split("=")[0].split("@")
    # every row once, up to the faulted step's (unless killed at `publish`, before its row)
    killed_before_row = point == "publish" and expected == -9
    assert steps == list(range(1, int(step) + 1 - killed_before_row)), (fault, steps)
    if expected == 130:  # stopped at the boundary of that step: its checkpoint is saved, and said so
      assert f"stopped; the checkpoint of step {step} is in" in out, out
  code, out = finish(train(workdir, "--config", config, "--resume"), workdir, timeout=180)
  assert code == 0, out
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3, 4, 5]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary == dict(json.loads(out.splitlines()[-1]), counters=summary["counters"])  # the line is the file's
  assert summary["steps"] == 5 and summary["resumes"] == len(CHAIN)
  after = [json.loads(line)["reward"] >= 1.0 for line in (workdir / "eval_after.jsonl").read_text().splitlines()]
  assert summary["accuracy_after"] == sum(after) / len(after) and len(after) == 2  # JobConfig.eval_prompts
  segments = json.loads((workdir / "run.json").read_text())["segments"]
  assert summary["rl_seconds"] == sum(s["seconds"] for s in segments) and len(segments) == len(CHAIN) + 1
  # a resumed run is one run: counters of every segment that ended (the killed ones left none), steps shown once
  ended = [s["counters"] for s in segments if s["counters"] is not None]
  assert summary["counted_segments"] == len(ended) == 1 + sum(code == 130 for _, code in CHAIN)
  assert summary["counters"]["samples_trained"] == sum(c["samples_trained"] for c in ended) > ended[-1]["samples_trained"]
  assert summary["counters"]["samples_trained"] == summary["counters"]["samples_planned"]  # a step cut short counts none
  assert scalar_steps(workdir / "tensorboard")["reward_mean"] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_checkpoints_every_few_steps_keep_a_stop_and_a_kill_exact(tmp_path):
  """With JobConfig.checkpoint_every=2 a Ctrl-C still saves the step it stops after; a kill resumes from the latest
  checkpoint and trains the steps after it again, each logged once."""
  config = write_config(tmp_path / "tiny.gin", steps=4, mode="async")
  workdir, every = tmp_path / "run", ("--set", "JobConfig.checkpoint_every=2")
  code, out = finish(train(workdir, "--config", config, *every, env={"STREAMRL_FAULT": "row@1=sigint"}), workdir,
                     timeout=180)
  assert code == 130 and "stopped; the checkpoint of step 1 is in" in out, out  # not due, saved for the stop
  code, out = finish(train(workdir, "--config", config, *every, "--resume", env={"STREAMRL_FAULT": "row@3=sigkill"}),
                     workdir, timeout=180)
  assert code == -9, out
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]  # 3 not due
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3]
  code, out = finish(train(workdir, "--config", config, *every, "--resume"), workdir, timeout=180)
  assert code == 0 and "resuming from the checkpoint of step 2" in out, out
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3, 4]
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]  # the last


def test_the_stall_watch_ends_a_silent_process_and_not_a_paused_or_progressing_one():
  now, said, ended = [0.0], [], []
  watch = StallWatch(30.0, said.append, lambda: now[0], end=ended.append)
  now[0] = 29.0
  watch._check()
  watch.progress("a shard of step 3 arrived")
  now[0] = 58.0
  watch._check()
  assert not ended
  watch._paused(100.0)  # this process was stopped for 100 s: not the trainer's silence
  now[0] = 150.0
  watch._check()
  assert not ended
  now[0] = 190.0
  watch._check()
  assert ended == [STALL_EXIT_CODE] and "no progress for 61 s since a shard of step 3 arrived" in said[0]
  assert "WaitConfig.step_timeout_s=30" in said[0]


@pytest.mark.slow
def test_a_stalled_step_ends_the_run_with_a_reason_and_the_last_checkpoint_resumes(tmp_path):
  """Step 2 hangs inside its checkpoint save (as a step stuck in a device wait would); the stall watch ends the
  process with exit code 124 and one line naming the last progress; the resume starts from step 1's checkpoint.
  (Run 1 stops after step 1, so run 2's programs come from the compilation cache: its steps take well under
  the 10 s limit.)"""
  config = write_config(tmp_path / "tiny.gin", steps=3, mode="async")
  workdir = tmp_path / "run"
  code, out = finish(train(workdir, "--config", config, env={"STREAMRL_FAULT": "row@1=sigint"}), workdir, timeout=180)
  assert code == 130, out
  code, out = finish(train(workdir, "--config", config, "--resume", "--set", "WaitConfig.step_timeout_s=10",
                           env={"STREAMRL_FAULT": "save@2=hang"}), workdir, timeout=180)
  assert code == STALL_EXIT_CODE, out
  assert "no progress for" in out and "since the end of step 2" not in out and "since the update of step 2" in out, out
  code, out = finish(train(workdir, "--config", config, "--resume"), workdir, timeout=180)
  assert code == 0, out
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3]
