"""Faults across processes: samplers lost, frozen, joining and leaving; the trainer frozen, killed and resumed.
Each prompt of each step is trained exactly once whatever happens (the trainer refuses to finish a step
otherwise), and the counters say what was leased again, late or refused. The controller's rules are checked
by hand first, with a clock the test moves; then the programs, as real processes on loopback."""

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from streamrl_jax.commands.launch_local import Child, ElasticSamplers, Supervisor
from streamrl_jax.messages import Heartbeat, LeaseRequest, Leave, Published, Register, StepReport, StepSummaryRequest
from streamrl_jax.models import CharTokenizer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.pipeline.controller.config import ControllerConfig
from streamrl_jax.pipeline.trainer.step_intake import IntakeRules, refusal
from streamrl_jax.streaming import SampleShard
from streamrl_jax.tasks import ArithmeticTask
from streamrl_jax.pipeline.parts import controller_setup
from tests.processes import FAULTS, TIMEOUT_S, Programs, alive, check_each_step_once, launch

CONFIG = PipelineConfig(mode="stream", steps=3, prompts_per_step=4, group_size=2, max_new_tokens=8)


class Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def make_controller(clock, **kwargs) -> Controller:
  config = dataclasses.replace(CONFIG, controller=ControllerConfig(lease_timeout_s=5.0))
  return Controller(controller_setup(config), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0, clock=clock,
                    **kwargs)


def groups(step: int, group_ids, completion: int = 5) -> SampleShard:
  """Whole groups of `step` (CONFIG.group_size samples each), `completion` tokens after a 1-token prompt."""
  rows = [(g, i) for g in group_ids for i in range(CONFIG.group_size)]
  n, width = len(rows), completion + 1
  return SampleShard(tokens=np.ones((n, width), np.int32), valid=np.ones((n, width), bool),
                     loss_mask=np.arange(width)[None].repeat(n, 0) > 0, logprobs=np.zeros((n, width), np.float32),
                     rewards=np.zeros(n, np.float32), group_ids=[g for g, _ in rows],
                     first_versions=np.zeros(n, np.int64), last_versions=np.zeros(n, np.int64),
                     sample_indices=[i for _, i in rows], steps=np.full(n, step))


def report(sampler_id: int, lease) -> StepReport:
  return StepReport(sampler_id, lease.lease_id, lease.step, 1.0, tuple(1.0 for _ in lease.prompts), 0.0,
                    len(lease.prompts) * CONFIG.group_size, 1, ())


def test_a_silent_sampler_loses_its_lease_to_another_and_is_told_to_register_again():
  clock = Clock()
  events = []
  controller = make_controller(clock, on_event=events.append)
  a, b = (controller.register(Register(name, {})).sampler_id for name in ("a", "b"))
  assert a != b
  controller.published(Published(0))
  lease_a, lease_b = (controller.lease(LeaseRequest(s, 0.0)).lease for s in (a, b))
  assert sorted(lease_a.group_ids + lease_b.group_ids) == [0, 1, 2, 3]  # step 0 cut in two, one lease each
  clock.now += 4.0
  controller.heartbeat(Heartbeat(b))
  assert controller.expire_silent() == []  # 4 s < lease_timeout_s
  clock.now += 2.0
  assert controller.expire_silent() == ["a"]  # a: 6 s silent; b: 2 s
  again = controller.lease(LeaseRequest(b, 0.0)).lease  # a's prompts, before any later step's
  assert (again.step, again.group_ids, again.prompts) == (0, lease_a.group_ids, lease_a.prompts)
  assert again.lease_id != lease_a.lease_id
  # a comes back: what it delivers is still taken (the trainer keeps the first copy), but it must rejoin
  assert controller.door.on_shard(a, groups(0, [lease_a.group_ids[0]])) == "late"
  assert controller.heartbeat(Heartbeat(a)).rejoin and controller.lease(LeaseRequest(a, 0.0)).rejoin
  assert controller.report(report(a, lease_a)).rejoin
  assert controller.door.on_shard(b, groups(0, again.group_ids)) == "accept"
  assert controller.door.on_shard(12345, groups(0, again.group_ids)) == "rejoin"  # never registered here
  for lease in (lease_b, again):
    assert not controller.report(report(b, lease)).rejoin
  assert controller.take_step_summary(StepSummaryRequest(0, timeout_s=1)).generation_s == 1.0
  counters = controller.counters
  assert (counters["samplers_lost"], counters["re_leased_leases"], counters["re_leased_prompts"]) == (1, 1, 2)
  assert (counters["late_samples"], counters["late_reports"], counters["rejoin_requests"]) == (2, 1, 3)
  assert [e["event"] for e in events] == ["sampler_joined", "sampler_joined", "sampler_lost", "re_leased_delivered"]
  assert events[2]["sampler"] == "a" and events[2]["leases_returned"] == 1


def test_a_lease_handed_back_is_cut_to_the_groups_still_missing():
  clock = Clock()
  controller = make_controller(clock)
  a, b, c = (controller.register(Register(name, {})).sampler_id for name in ("a", "b", "c"))
  controller.published(Published(0))
  lease_a, lease_b, lease_c = (controller.lease(LeaseRequest(s, 0.0)).lease for s in (a, b, c))
  assert (lease_a.group_ids, lease_b.group_ids, lease_c.group_ids) == ((0, 1), (2,), (3,))
  assert controller.door.on_shard(a, groups(0, [0], completion=7)) == "accept"  # a delivers group 0 of its two, then dies
  assert controller.door.on_shard(b, groups(0, [2], completion=9)) == "accept"  # b delivers its only group, dies before reporting
  clock.now += 4.0
  controller.heartbeat(Heartbeat(c))
  clock.now += 2.0
  assert sorted(controller.expire_silent()) == ["a", "b"]
  again = controller.lease(LeaseRequest(c, 0.0)).lease
  assert (again.group_ids, again.prompts) == ((1,), lease_a.prompts[1:])  # only what is missing
  assert controller.lease(LeaseRequest(c, 0.0)).lease is None  # nothing of b's to redo; step 1 is gated
  counters = controller.counters
  assert (counters["re_leased_prompts"], counters["groups_kept"]) == (1, 2)
  for lease in (lease_c, again):
    controller.report(report(c, lease))
  summary = controller.take_step_summary(StepSummaryRequest(0, timeout_s=1)).metrics()  # made without b's report
  assert summary["generation_s"] == 1.0 and (summary["sampler_instances"], summary["sampler_processes"]) == (1, 1)


def test_a_sampler_that_leaves_returns_its_leases_and_a_joiner_takes_the_next_plan():
  clock = Clock()
  controller = make_controller(clock)
  a = controller.register(Register("a", {})).sampler_id
  controller.published(Published(0))
  first = controller.lease(LeaseRequest(a, 0.0)).lease
  assert first.group_ids == (0, 1, 2, 3)  # one sampler: the whole step
  b = controller.register(Register("b", {})).sampler_id
  controller.leave(Leave(a))
  assert controller.lease(LeaseRequest(b, 0.0)).lease.group_ids == first.group_ids
  c = controller.register(Register("c", {})).sampler_id
  controller.published(Published(1))
  leases = [controller.lease(LeaseRequest(s, 0.0)).lease for s in (b, c)]
  assert [lease.step for lease in leases] == [1, 1] and sorted(leases[0].group_ids + leases[1].group_ids) == [4, 5, 6, 7]
  assert controller.counters["samplers_left"] == 1 and controller.counters["samplers_lost"] == 0


def test_a_late_watchdog_tick_blames_this_process_not_the_samplers():
  """SIGSTOP of the trainer looks, from inside, like every sampler went silent at once."""
  clock = Clock()
  events = []
  controller = make_controller(clock, on_event=events.append)
  a = controller.register(Register("a", {})).sampler_id
  after_pause, checked = [], threading.Event()
  expire = controller.expire_silent

  def check() -> list[str]:  # the watchdog's regular tick, counted once the pause was seen
    lost = expire()
    if any(e["event"] == "trainer_paused" for e in events):
      after_pause.append(lost)
      if len(after_pause) >= 3:
        checked.set()
    return lost
  controller.expire_silent = check
  controller.start_watchdog(period=0.02)
  try:
    clock.now += 60.0  # the process was paused for a minute
    assert checked.wait(30), events  # three regular ticks after the late one
  finally:
    controller.close()
  assert after_pause[:3] == [[], [], []]  # later ticks see a fresh heartbeat: nobody blamed
  assert controller.counters["samplers_lost"] == 0 and not controller.heartbeat(Heartbeat(a)).rejoin


def shard_of(step, group_ids, sample_indices, width=4) -> SampleShard:
  n = len(group_ids)
  return SampleShard(tokens=np.ones((n, width), np.int32), valid=np.ones((n, width), bool),
                     loss_mask=np.ones((n, width), bool), logprobs=np.zeros((n, width), np.float32),
                     rewards=np.zeros(n, np.float32), group_ids=np.array(group_ids),
                     first_versions=np.zeros(n, np.int64), last_versions=np.zeros(n, np.int64),
                     sample_indices=np.array(sample_indices), steps=np.full(n, step))


def test_the_trainer_refuses_a_sample_its_step_did_not_plan():
  rules = IntakeRules.of(CONFIG.shape)
  assert re.search(r"step 2 received sample \(group 8, index 1\).*groups 4..7",
                   refusal(shard_of(1, [4, 8], [0, 1]), rules))
  assert refusal(shard_of(1, [4, 7], [0, 1]), rules) is None
  assert "index 2" in refusal(shard_of(1, [4, 4], [0, 2]), rules)  # group_size 2: indices 0 and 1
  assert "holds a sample twice" in refusal(shard_of(1, [4, 4], [1, 1]), rules)
  assert "a shard of step 8; the run has 3 steps" in refusal(shard_of(7, [28, 28], [0, 1]), rules)
  mixed = SampleShard(**{**shard_of(1, [4, 4], [0, 1]).__dict__, "steps": np.array([1, 2])})
  assert "mixes samples of steps [2, 3]" in refusal(mixed, rules)  # as rows number them


# ---- the programs (started and killed by `tests.processes.Programs`) -------------------------------------
@pytest.mark.slow
def test_chaos_samplers_killed_frozen_and_joining(tmp_path):
  """A 20-step run with two samplers: at steps 3, 8 and 13 one is killed (SIGKILL) and a fresh one started;
  at step 5 one is frozen past the lease timeout and thawed (it is declared lost, comes back, registers again); at
  step 10 a third one joins. At each of those steps the trainer holds after the step's row (a fault point: the run
  cannot end meanwhile) until the fault is done and every sampler started has registered, so which samplers join
  does not race the clock. The run completes and trains each prompt of each step exactly once."""
  steps, chaos, hold = 20, random.Random(7), tmp_path / "holding"
  run = Programs(tmp_path, steps, mode="async")
  try:
    holds = ",".join(f"row@{at}=hold" for at in (3, 5, 8, 10, 13))
    run.start("trainer", "trainer", env={"STREAMRL_FAULT": holds, "STREAMRL_FAULT_FILE": str(hold)})
    live = []

    def new_sampler() -> None:
      live.append(f"s{len(run.procs) - 1}")
      run.start("sampler", live[-1])
    new_sampler()
    new_sampler()
    frozen = None
    for at, fault in ((3, "kill"), (5, "freeze"), (8, "kill"), (10, "join"), (13, "kill")):
      run.wait_until(hold.exists, f"the trainer holding after step {at}")
      assert hold.read_text() == f"row@{at}"
      if fault == "kill":  # any sampler but the frozen one, which must live to register again
        run.procs[live.pop(chaos.choice([i for i, name in enumerate(live) if name != frozen]))].kill()
      if fault in ("kill", "join"):
        new_sampler()
        run.wait_until(lambda: run.joined(live[-1]) == 1, f"{live[-1]} registering")
      else:
        frozen = live[chaos.randrange(len(live))]
        os.kill(run.procs[frozen].pid, signal.SIGSTOP)
        run.wait_until(lambda: run.lost(frozen), f"{frozen} declared lost")  # silent past the lease timeout
        os.kill(run.procs[frozen].pid, signal.SIGCONT)
        run.wait_until(lambda: run.joined(frozen) == 2, f"{frozen} registering again")
      hold.unlink()  # the trainer goes on
    assert run.wait_exit("trainer") == 0, run.tails()
    for name in live:  # a sampler whose last call finds the trainer gone retries for FlightConfig.connect_retry_s
      assert run.wait_exit(name, timeout=150) == 0, run.tails()
  finally:
    run.kill_all()
  counters = check_each_step_once(tmp_path, steps)
  # every prompt was either reported in a lease or delivered by a lost sampler before it was lost
  assert counters["samples_trained"] == steps * 8
  assert counters["prompts_submitted"] + counters["groups_kept"] == steps * 4
  # the thawed sampler was told to register again by whichever call of its reached the trainer first: a heartbeat
  # or lease request (rejoin_requests) or its report of the lease it lost (late_reports)
  assert counters["samplers_lost"] >= 2 and counters["rejoin_requests"] + counters["late_reports"] >= 1
  assert "registering again" in run.logs[frozen].read_text()
  joined = [e for e in run.events() if e["event"] == "sampler_joined"]
  # s0 and s1, the three started after a kill, the one joining at step 10, and the frozen one once more
  late = [e["next_step"] for e in joined if e["sampler"] == "s4"]
  assert len(joined) == 7 and len(late) == 1 and late[0] > 10, joined


@pytest.mark.slow
def test_trainer_frozen_then_killed_and_resumed_samplers_reconnect(tmp_path):
  """The trainer is frozen for 10 s (SIGSTOP: a partition, as samplers see it) at step 3, and killed
  (SIGKILL) at step 6 and started again with --resume: samplers wait, keep their unacknowledged shards,
  register with the new trainer, fetch its weights and go on. Samples of the killed trainer's queue are
  generated again (the new trainer refuses shards of samplers it does not know); each step appears once."""
  steps = 12
  run = Programs(tmp_path, steps, mode="stream")
  try:
    trainer = run.start("trainer", "trainer")
    for i in range(2):
      run.start("sampler", f"s{i}")
    run.wait_until(lambda: run.steps_done() >= 3, "step 3")
    os.kill(trainer.pid, signal.SIGSTOP)
    time.sleep(10.0)
    os.kill(trainer.pid, signal.SIGCONT)
    run.wait_until(lambda: run.steps_done() >= 6, "step 6")
    trainer.kill()
    trainer.wait(timeout=30)
    run.start("trainer", "trainer", "--resume")
    assert run.wait_exit("trainer") == 0, run.tails()
    for i in range(2):
      assert run.wait_exit(f"s{i}", timeout=60) == 0, run.tails()
  finally:
    run.kill_all()
  counters = check_each_step_once(tmp_path, steps, trainer_restarts=1)
  assert counters["samplers_lost"] == 0  # the freeze was the trainer's own: no sampler blamed
  events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
  assert "trainer_paused" in events and "resuming from the checkpoint" in run.logs["trainer"].read_text()
  assert all("registering again" in run.logs[f"s{i}"].read_text() for i in range(2))


@pytest.mark.slow
def test_a_sampler_that_cannot_reach_the_trainer_exits_with_a_clear_message(tmp_path):
  run = Programs(tmp_path, 2, mode="stream")
  proc = run.start("sampler", "lonely", "--set", "FlightConfig.connect_retry_s=2.0")
  try:
    code = proc.wait(timeout=120)
  finally:
    if alive(proc.pid):
      proc.kill()
  assert code == 3
  assert f"the trainer at {run.address} did not take the call for 2 s" in run.logs["lonely"].read_text()


def test_elastic_sampler_count_by_hand():
  elastic = ElasticSamplers(low=1, high=3, hysteresis=0.05)
  assert elastic.target(1, generation_s=4.0, train_s=1.0) == 2  # lags by 3 s; one more saves 2 s
  assert elastic.target(1, generation_s=1.5, train_s=1.0) == 1  # lags by 0.5 s; one more would save 0.75 s
  assert elastic.target(3, generation_s=9.0, train_s=1.0) == 3  # at the ceiling
  assert elastic.target(2, generation_s=1.0, train_s=4.0) == 1  # one fewer: 2 s, still ahead of training
  assert elastic.target(2, generation_s=2.0, train_s=4.0) == 2  # one fewer would make generation 4 s + margin
  assert elastic.target(1, generation_s=0.1, train_s=4.0) == 1  # at the floor
  with pytest.raises(ValueError, match="--min-samplers"):
    ElasticSamplers(low=0, high=2)


def test_the_launcher_decides_again_only_once_an_added_sampler_has_joined(tmp_path, monkeypatch):
  """The supervisor's elastic loop on metrics and events it is handed: generation lags, so it adds a sampler;
  while that one has not joined, lagging steps add nobody; once it has joined and `cooldown_steps` steps have
  passed, the next one is added. One step's recompile (train_s 5 s) among three does not stop a decision."""
  metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"

  def steps(first: int, last: int, train_s=lambda step: 0.1) -> None:
    with metrics.open("a") as out:
      for step in range(first, last + 1):
        out.write(json.dumps(dict(step=step, generation_s=1.0, train_s=train_s(step))) + "\n")

  def joined(name: str) -> None:
    with events.open("a") as out:
      out.write(json.dumps(dict(event="sampler_joined", sampler=name)) + "\n")
  # Plain children: the launcher's own start runs Python between fork and exec, unsafe in this (JAX) process.
  monkeypatch.setattr(Child, "start", lambda child: setattr(child, "proc", subprocess.Popen(child.argv)))
  wait = [sys.executable, "-c", "import time; time.sleep(60)"]
  children = [Child("trainer", wait, None, None), Child("sampler-0", wait + ["--name", "sampler-0"], None,
                                                         tmp_path / "sampler-0.log")]
  supervisor = Supervisor(children, 1, tmp_path, elastic=ElasticSamplers(low=1, high=3))
  try:
    for child in children:
      child.start()
    joined("sampler-0")
    steps(1, 4, train_s=lambda step: 5.0 if step == 3 else 0.1)
    supervisor._scale()
    assert [c.name for c in supervisor.samplers()] == ["sampler-0", "sampler-1"]
    assert children[-1].argv[-1] == "sampler-1"
    steps(5, 12)
    supervisor._scale()  # sampler-1 is still starting: its absence from the figures is no reason to add more
    assert len(supervisor.samplers()) == 2
    joined("sampler-1")
    steps(13, 13)
    supervisor._scale()  # joined at step 13: the window starts there
    steps(14, 15)
    supervisor._scale()
    assert len(supervisor.samplers()) == 2
    steps(16, 16)
    supervisor._scale()
    assert [c.name for c in supervisor.samplers()] == ["sampler-0", "sampler-1", "sampler-2"]
  finally:
    for child in supervisor.children:
      child.signal(signal.SIGKILL)
      if child.proc is not None:
        child.proc.wait(timeout=10)


@pytest.mark.slow
def test_launch_local_adds_a_sampler_process_when_generation_lags(tmp_path):
  """Long random completions (192 tokens) of an untrained model against a tiny training step: generation
  lags (by more than one more process would save: over twice the training), so the launcher starts a second
  sampler process, which joins the run; nothing lost or doubled. The launcher makes no further decision until
  the added process has joined, so a slow start is never read as a sampler that does not help (and retired
  before it ever took a lease)."""
  config = tmp_path / "elastic.gin"
  steps = 60  # about 50 s of steps after the first: time for the added process to start and take leases
  config.write_text(FAULTS.format(steps=steps, trainer_devices=1, mode="async").replace(
      "max_new_tokens = 8", "max_new_tokens = 192"))
  proc = launch(tmp_path, "--config", str(config), "--samplers", "1", "--max-samplers", "2")
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  finally:
    for pid in [proc.pid] + [c["pid"] for c in json.loads((tmp_path / "launch.json").read_text())
                             if (tmp_path / "launch.json").exists()]:
      if alive(pid):
        os.kill(pid, signal.SIGKILL)
  assert proc.returncode == 0, out
  assert "launch[" in out and "INFO adding sampler-1 (generation" in out
  counters = check_each_step_once(tmp_path, steps)
  assert counters["samples_trained"] == steps * 8
  events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
  # The added process joined; with the packed trainer's faster steps the decision may later retire one and
  # add another (sampler-2): every step above still trained its samples exactly once.
  assert {"sampler-0", "sampler-1"} <= {e["sampler"] for e in events if e["event"] == "sampler_joined"}


def test_a_long_poll_waiting_in_the_controller_does_not_keep_a_silent_sampler_alive():
  """A frozen sampler's lease request may sit in the controller; its waiting is not the sampler's voice."""
  clock = Clock()
  controller = make_controller(clock)
  a = controller.register(Register("a", {})).sampler_id
  asked = [threading.Event(), threading.Event()]  # the request looked for a lease: once on entry, once woken
  lease_now = controller._lease_now

  def looked(sampler_id):
    reply = lease_now(sampler_id)
    next((e for e in asked if not e.is_set()), threading.Event()).set()
    return reply
  controller._lease_now = looked
  waiting = threading.Thread(target=controller.lease, args=(LeaseRequest(a, 30.0),))
  waiting.start()  # no step is open (nothing published): the request waits
  assert asked[0].wait(10)
  with controller._cond:  # taken once the request waits on the condition (it releases the lock there)
    clock.now += 6.0
    controller.set_target_instances(1)
    controller._cond.notify_all()  # wake the waiting request, as any event would
  assert asked[1].wait(10)  # it woke, found nothing and waits again
  assert controller.expire_silent() == ["a"]
  waiting.join(timeout=30)  # the run over (its sampler lost), the request is answered
  assert not waiting.is_alive()

