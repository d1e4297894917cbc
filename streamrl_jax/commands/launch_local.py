"""`streamrl launch local`: one trainer and N sampler processes on this machine (and with `--arms` and
`ArmsConfig.programs`, a `streamrl follower` process per arm, restarted like a sampler when it dies).

The trainer (one process, or several forming one `jax.distributed` cluster) keeps the terminal (its progress bar);
samplers write to `WORKDIR/logs/`. With `--pin-cores` every process runs on its own CPU cores
(`os.sched_setaffinity`, set before the child starts, so XLA sizes its threads to them). Children run in their own
sessions and die with the launcher (`PR_SET_PDEATHSIG`); Ctrl-C (or SIGTERM) asks the trainer to finish its step,
checkpoint and stop while the samplers still serve it, then stops the samplers, and kills whatever has not exited
after a grace period: no orphans. A second Ctrl-C stops the trainer at once. A sampler that dies is started again (up
to `--sampler-restarts` times in all; the trainer leases its prompts to the others meanwhile), unless it exited with
a configuration or reward function's error (code 2); a trainer that dies stops the run. `--max-samplers M` adds or
retires sampler processes between steps by the elastic decision (`scheduling.elastic_decision`, on each step's
generation and training seconds from `metrics.jsonl`), between `--min-samplers` and M; a retired sampler hands its
leases back as it leaves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from streamrl_jax.settings import renamed

_log = logging.getLogger(__name__)
STOP_SAVE_MARGIN_S = 60.0  # a stopping trainer's checkpoint and teardown, beyond its stop grace
FAILURE_STOP_S = 60.0  # after a child failed: how long the trainer may take to stop
SAMPLER_EXIT_GRACE_S = 30.0
FOLLOWER_EXIT_GRACE_S = 900.0  # after the trainer: a follower program evaluates and saves its policy
ARM_CHILD = "arm-"  # follower programs' names: arm-NAME
USAGE_ERROR = 2  # `streamrl ...: error: ...` (a config or user-code mistake): starting it again would repeat it


def add_launch_parser(sub, common) -> None:
  launch = sub.add_parser("launch", help="start a run's trainer and sampler programs")
  where = launch.add_subparsers(dest="where", required=True)
  local = where.add_parser("local", help="one trainer and N sampler processes on this machine")
  common(local)
  local.add_argument("--workdir", required=True, help="the trainer's workdir; sampler logs go to WORKDIR/logs")
  local.add_argument("--samplers", type=int, default=1, help="sampler processes (default 1)")
  local.add_argument("--trainer-processes", type=int, default=1,
                     help="processes of the trainer, one jax.distributed cluster (default 1)")
  local.add_argument("--pin-cores", action="store_true", help="run each process on its own CPU cores")
  local.add_argument("--sampler-restarts", type=int, default=3,
                     help="how many times in all a sampler that dies is started again (default 3)")
  local.add_argument("--max-samplers", type=int, default=None,
                     help="grow and shrink sampler processes by the elastic decision, up to this many")
  local.add_argument("--min-samplers", type=int, default=1, help="with --max-samplers: the fewest (default 1)")
  local.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the workdir")
  from streamrl_jax.commands.train import arms_arg
  arms_arg(local)
  local.set_defaults(run=cmd_launch_local)
  from streamrl_jax.commands.launch_gke import add_gke_parser
  add_gke_parser(where, common)


def assign_cores(cores: list[int], trainer_processes: int, samplers: int) -> list[list[int]]:
  """Disjoint cores per process, trainer processes first: the trainer role gets half (at least one per
  process), the samplers share the rest evenly."""
  needed = trainer_processes + samplers
  if len(cores) < needed:
    raise ValueError(f"--pin-cores needs a core per process: {needed} processes, {len(cores)} cores available")
  trainer_share = min(max(trainer_processes, len(cores) // 2), len(cores) - samplers)
  trainer = np.array_split(np.asarray(cores[:trainer_share]), trainer_processes)
  rest = np.array_split(np.asarray(cores[trainer_share:]), samplers) if samplers else []
  return [part.tolist() for part in list(trainer) + list(rest)]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Child:
  name: str
  argv: list[str]
  cores: list[int] | None
  log: Path | None  # None: the launcher's terminal
  proc: subprocess.Popen | None = None
  retired: bool = False  # asked to leave by the elastic decision: its exit is no failure

  def start(self) -> None:
    out = self.log.open("ab") if self.log else None
    self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                 start_new_session=True, preexec_fn=functools.partial(_child_setup, self.cores))
    if out:
      out.close()

  def signal(self, sig: int) -> None:
    if self.proc is not None and self.proc.poll() is None:
      try:
        self.proc.send_signal(sig)
      except ProcessLookupError:
        pass


def _child_setup(cores: list[int] | None) -> None:
  """In the child before exec: its CPU cores, and death with the launcher (Linux)."""
  if cores is not None:
    os.sched_setaffinity(0, cores)
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def plan_children(args, cores: list[int] | None, arm_programs=()) -> list[Child]:
  """The trainer's processes, the samplers, then a `streamrl follower` per (arm name, file) of `arm_programs` (its
  workdir the trainer's WORKDIR/arms/NAME)."""
  base = [sys.executable, "-m", "streamrl_jax.cli"]
  config = [a for f in args.config for a in ("--config", f)] + [a for b in args.set for a in ("--set", b)]
  workdir = Path(args.workdir)
  address = f"127.0.0.1:{free_port()}"
  coordinator = f"127.0.0.1:{free_port()}" if args.trainer_processes > 1 else None
  children = []
  for i in range(args.trainer_processes):
    argv = base + ["trainer", "--workdir", str(workdir), "--listen", address, *config]
    argv += ["--resume"] if args.resume else []
    argv += ["--arms", *args.arms] if args.arms else []
    if coordinator:
      argv += ["--coordinator", coordinator, "--num-processes", str(args.trainer_processes), "--process-id", str(i)]
    children.append(Child(f"trainer-{i}" if coordinator else "trainer", argv, cores[i] if cores else None,
                          None if i == 0 else workdir / "logs" / f"trainer-{i}.log"))
  for k in range(args.samplers):
    argv = base + ["sampler", "--connect", address, "--name", f"sampler-{k}", *config]
    children.append(Child(f"sampler-{k}", argv, cores[args.trainer_processes + k] if cores else None,
                          workdir / "logs" / f"sampler-{k}.log"))
  for name, path in arm_programs:
    argv = base + ["follower", "--connect", address, "--arm", path, "--workdir", str(workdir / "arms" / name), *config]
    children.append(Child(f"{ARM_CHILD}{name}", argv, None, workdir / "logs" / f"{ARM_CHILD}{name}.log"))
  return children


@dataclasses.dataclass(frozen=True)
class ElasticSamplers:
  """Sampler processes between `low` and `high`, changed by at most one per decision; after a change,
  `cooldown_steps` steps pass before the next decision, so a new sampler's start-up is not misread."""

  low: int
  high: int
  hysteresis: float = 0.05
  cooldown_steps: int = 3

  def __post_init__(self):
    if not 1 <= self.low <= self.high:
      raise ValueError(f"need 1 <= --min-samplers ({self.low}) <= --max-samplers ({self.high})")

  def target(self, current: int, generation_s: float, train_s: float) -> int:
    """The sampler count for the next steps, by the one elastic rule (`policies.elastic_target`)."""
    from streamrl_jax.scheduling.policies import elastic_target

    return elastic_target(current, generation_s, train_s, low=self.low, high=self.high, hysteresis=self.hysteresis)


def cmd_launch_local(args) -> int:
  from streamrl_jax.gin_config import pinned_hub_model
  if args.samplers < 1 or args.trainer_processes < 1:
    raise ValueError("--samplers and --trainer-processes must be >= 1")
  elastic = None
  if args.max_samplers is not None:
    elastic = ElasticSamplers(args.min_samplers, args.max_samplers)
    if not elastic.low <= args.samplers <= elastic.high:
      raise ValueError(f"--samplers {args.samplers} must lie between --min-samplers {elastic.low} and "
                       f"--max-samplers {elastic.high}")
    if args.pin_cores:
      raise ValueError("--pin-cores splits the cores at start; it cannot be combined with --max-samplers")
  args.set = pinned_hub_model(args.config, args.set)  # a Hub model id pinned to its commit: one snapshot for all
  arm_programs = _check_arms(args) if args.arms else ()
  if arm_programs and args.pin_cores:
    raise ValueError("--pin-cores splits the cores between the trainer and samplers; follower programs "
                     "(ArmsConfig.programs) would share them: drop one")
  cores = None
  if args.pin_cores:
    cores = assign_cores(sorted(os.sched_getaffinity(0)), args.trainer_processes, args.samplers)
  children = plan_children(args, cores, arm_programs)
  workdir = Path(args.workdir)
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    for child in children:
      child.start()
    _write_manifest(workdir, children)
    logs = ", ".join(f"{c.name}: {c.log}" for c in children if c.log)
    _log.info("%d processes (%s)", len(children), logs)
    return Supervisor(children, args.trainer_processes, workdir, args.sampler_restarts, elastic).run()
  except KeyboardInterrupt:
    _log.warning("stopping (the trainer finishes its step and checkpoints; Ctrl-C again to stop at once)")
    _stop(children, children[:args.trainer_processes], trainer_stop_wait_s(workdir))
    _log.warning("stopped (the trainer's last line says what is checkpointed)")
    return 130
  finally:
    _kill_leftovers(children)
    signal.signal(signal.SIGTERM, previous)


def _check_arms(args) -> tuple:
  """`--arms` files refused here, before any process starts (the trainer would refuse them the same way); returns
  (arm name, file) of each follower program to start (none when the arms train in the trainer's program)."""
  from streamrl_jax import gin_config

  if args.trainer_processes > 1:
    raise ValueError("--arms: follower arms run beside a trainer of one process; drop --trainer-processes")
  files = gin_config.run_files(args.config)
  gin_config.parse(files, args.set)
  config = gin_config.with_arms(*gin_config.build_run(), args.arms, files, args.set)
  return tuple(zip((arm.name for arm in config.arms.followers), args.arms)) if config.arms.programs else ()


def _write_manifest(workdir: Path, children: list[Child]) -> None:
  """WORKDIR/launch.json: each child's name, pid, cores and log."""
  (workdir / "launch.json").write_text(json.dumps(
      [dict(name=c.name, pid=c.proc.pid, cores=c.cores, log=str(c.log) if c.log else None) for c in children],
      indent=2))


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt


class Supervisor:
  """Watches the children until the trainer exits: restarts samplers that fail (while restarts last), stops
  the run when a trainer process fails, and with `elastic` adds or retires samplers between steps. It runs
  on the launcher's one thread and owns the children list."""

  def __init__(self, children: list[Child], trainer_processes: int, workdir: Path, restarts: int = 0,
               elastic: ElasticSamplers | None = None):
    self.children, self.trainers = children, children[:trainer_processes]
    self.workdir, self.restarts, self.elastic = workdir, restarts, elastic
    self.steps_seen, self.changed_at = 0, 1  # the first step (compiles) never counts
    self.waiting_for: Child | None = None  # an added sampler that has not joined yet: no decision until it has
    self.started = len(children) - trainer_processes  # samplers ever started: names stay unique

  def samplers(self) -> list[Child]:
    return [c for c in self.children if c not in self.trainers and not c.name.startswith(ARM_CHILD)]

  def followers(self) -> list[Child]:
    return [c for c in self.children if c.name.startswith(ARM_CHILD)]

  def run(self) -> int:
    while any(c.proc.poll() is None for c in self.trainers):
      code = self._check_exits()
      if code is not None:
        return code
      if self.elastic is not None:
        self._scale()
      time.sleep(0.2)
    deadline = time.monotonic() + SAMPLER_EXIT_GRACE_S
    while any(c.proc.poll() is None for c in self.samplers()) and time.monotonic() < deadline:
      time.sleep(0.2)
    deadline = time.monotonic() + FOLLOWER_EXIT_GRACE_S  # they evaluate and save their policies
    while any(c.proc.poll() is None for c in self.followers()) and time.monotonic() < deadline:
      time.sleep(0.2)
    failed = [c for c in self.followers() if c.proc.returncode not in (None, 0)]
    for child in failed:
      _log.error("%s exited with code %s (its log: %s)", child.name, child.proc.returncode, child.log)
    return self.trainers[0].proc.returncode

  def _check_exits(self) -> int | None:
    for child in self.children:
      code = child.proc.poll()
      if code in (None, 0) or child.retired:
        continue
      said = f"{child.name} exited with code {code}"
      if child not in self.trainers and self.restarts > 0 and code != USAGE_ERROR:
        self.restarts -= 1
        _log.warning("%s; starting it again (%d restart(s) left)", said, self.restarts)
        child.start()
        _write_manifest(self.workdir, self.children)
        continue
      _log.error(said + (f"; the end of its log ({child.log}):\n{_tail(child.log)}" if child.log else ""))
      if child.name.startswith(ARM_CHILD):  # the lead and the other arms go on; the arm resumes on a later run
        child.retired = True
        continue
      _stop(self.children, self.trainers, FAILURE_STOP_S)
      return code
    return None

  def _scale(self) -> None:
    """One elastic decision on the median figures of the last `cooldown_steps` steps, all after the last
    change took effect: a sampler the launcher added counts once it has joined the run (its start-up and
    first compile take far longer than a step), and the median keeps one step's recompile from reading as
    slow training."""
    rows = _read_jsonl(self.workdir / "metrics.jsonl")
    if len(rows) <= self.steps_seen:
      return
    self.steps_seen = len(rows)
    live = [c for c in self.samplers() if not c.retired]
    if self.waiting_for is not None:
      if self.waiting_for.proc.poll() is None and self.waiting_for.name not in _joined(self.workdir):
        return
      self.waiting_for, self.changed_at = None, self.steps_seen
    window = self.elastic.cooldown_steps
    if self.steps_seen - self.changed_at < window:
      return
    recent = rows[-window:]
    generation_s = float(np.median([r["generation_s"] for r in recent]))
    train_s = float(np.median([r["train_s"] for r in recent]))
    target = self.elastic.target(len(live), generation_s, train_s)
    if target == len(live):
      return
    why = (f"generation {generation_s:.2f} s vs training {train_s:.2f} s a step, steps "
           f"{recent[0]['step']}-{recent[-1]['step']}")
    if target > len(live):
      template = self.samplers()[0]
      child = dataclasses.replace(template, name=f"sampler-{self.started}", proc=None, retired=False,
                                  argv=_renamed(template.argv, f"sampler-{self.started}"),
                                  log=template.log.with_name(f"sampler-{self.started}.log"))
      self.started += 1
      child.start()
      self.children.append(child)
      self.waiting_for = child
      _log.info("adding %s (%s)", child.name, why)
    else:
      child = live[-1]
      child.retired = True
      child.signal(signal.SIGTERM)  # it leaves: its leases go back to the plan
      _log.info("retiring %s (%s)", child.name, why)
    self.changed_at = self.steps_seen
    _write_manifest(self.workdir, self.children)


def _renamed(argv: list[str], name: str) -> list[str]:
  i = argv.index("--name")
  return argv[:i + 1] + [name] + argv[i + 2:]


def _joined(workdir: Path) -> set[str]:
  """Names of the samplers that have registered with the trainer so far (WORKDIR/events.jsonl)."""
  return {e.get("sampler") for e in _read_jsonl(workdir / "events.jsonl") if e.get("event") == "sampler_joined"}


def _read_jsonl(path: Path) -> list[dict]:
  """The complete rows of a JSON-lines file (metrics.jsonl, events.jsonl) so far (a row being written is left for the next read)."""
  try:
    lines = path.read_text().splitlines(keepends=True)
  except OSError:
    return []
  return [json.loads(line) for line in lines if line.endswith("\n")]


def _stop(children: list[Child], trainers: list[Child], trainer_wait_s: float) -> None:
  """SIGINT to the trainer's process 0 (it finishes its step, metrics row and checkpoint, and exits; its other
  processes follow it), waiting up to `trainer_wait_s` while the samplers still serve that step; then SIGTERM to
  the rest (samplers hand their leases back) and up to SAMPLER_EXIT_GRACE_S more. A second Ctrl-C ends the
  wait for the trainer (told again, it stops at once); whatever still runs afterwards is killed by the caller."""
  trainers[0].signal(signal.SIGINT)
  try:
    _wait_exit(trainers, trainer_wait_s)
  except KeyboardInterrupt:
    trainers[0].signal(signal.SIGINT)
  for child in children:
    if child is not trainers[0]:
      child.signal(signal.SIGTERM)
  try:
    _wait_exit(children, SAMPLER_EXIT_GRACE_S)
  except KeyboardInterrupt:  # once more: no more waiting
    pass


def _wait_exit(children: list[Child], seconds: float) -> None:
  deadline = time.monotonic() + seconds
  while any(c.proc is not None and c.proc.poll() is None for c in children) and time.monotonic() < deadline:
    time.sleep(0.2)


def trainer_stop_wait_s(workdir: Path) -> float:
  """How long a stopping trainer may take: its `WaitConfig.stop_grace_s` (from the settings it wrote in
  WORKDIR/settings.json; none yet: it is not in a step, it stops at once) and STOP_SAVE_MARGIN_S for its
  checkpoint and teardown."""
  try:
    settings = renamed(json.loads((workdir / "settings.json").read_text()))  # a workdir written before the key moved
    grace = float(settings.get("WaitConfig.stop_grace_s", "0"))
  except (OSError, ValueError):
    grace = 0.0
  return grace + STOP_SAVE_MARGIN_S


def _kill_leftovers(children: list[Child]) -> None:
  for child in children:
    if child.proc is not None and child.proc.poll() is None:
      child.signal(signal.SIGKILL)
      child.proc.wait(timeout=10)


def _tail(path: Path, lines: int = 20) -> str:
  try:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
  except OSError:
    return "(no log)"
