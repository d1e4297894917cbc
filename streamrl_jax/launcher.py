"""`streamrl launch local`: one trainer and N sampler processes on this machine.

The trainer (one process, or several forming one `jax.distributed` cluster) keeps the terminal (its progress
bar); samplers write to `WORKDIR/logs/`. With `--pin-cores` every process runs on its own CPU cores
(`os.sched_setaffinity`, set before the child starts, so XLA sizes its threads to them). Children run in
their own sessions and die with the launcher (`PR_SET_PDEATHSIG`); Ctrl-C (or SIGTERM) asks the trainer to
checkpoint and stop, stops the samplers, and kills whatever has not exited after a grace period: no orphans.
A sampler that dies is started again (up to `--sampler-restarts` times in all; the trainer leases its
prompts to the others meanwhile); a trainer that dies stops the run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

STOP_GRACE_S = 60.0
SAMPLER_EXIT_GRACE_S = 30.0


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
  local.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the workdir")
  local.set_defaults(run=cmd_launch_local)


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


def plan_children(args, cores: list[int] | None) -> list[Child]:
  base = [sys.executable, "-m", "streamrl_jax.cli"]
  config = [a for f in args.config for a in ("--config", f)] + [a for b in args.set for a in ("--set", b)]
  workdir = Path(args.workdir)
  address = f"127.0.0.1:{free_port()}"
  coordinator = f"127.0.0.1:{free_port()}" if args.trainer_processes > 1 else None
  children = []
  for i in range(args.trainer_processes):
    argv = base + ["trainer", "--workdir", str(workdir), "--listen", address, *config]
    argv += ["--resume"] if args.resume else []
    if coordinator:
      argv += ["--coordinator", coordinator, "--num-processes", str(args.trainer_processes), "--process-id", str(i)]
    children.append(Child(f"trainer-{i}" if coordinator else "trainer", argv, cores[i] if cores else None,
                          None if i == 0 else workdir / "logs" / f"trainer-{i}.log"))
  for k in range(args.samplers):
    argv = base + ["sampler", "--connect", address, "--name", f"sampler-{k}", *config]
    children.append(Child(f"sampler-{k}", argv, cores[args.trainer_processes + k] if cores else None,
                          workdir / "logs" / f"sampler-{k}.log"))
  return children


def cmd_launch_local(args) -> int:
  if args.samplers < 1 or args.trainer_processes < 1:
    raise ValueError("--samplers and --trainer-processes must be >= 1")
  cores = None
  if args.pin_cores:
    cores = assign_cores(sorted(os.sched_getaffinity(0)), args.trainer_processes, args.samplers)
  children = plan_children(args, cores)
  workdir = Path(args.workdir)
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    for child in children:
      child.start()
    _write_manifest(workdir, children)
    logs = ", ".join(f"{c.name}: {c.log}" for c in children if c.log)
    print(f"streamrl launch local: {len(children)} processes ({logs})", file=sys.stderr, flush=True)
    return _supervise(children, args.trainer_processes, args.sampler_restarts,
                      on_restart=lambda: _write_manifest(workdir, children))
  except KeyboardInterrupt:
    _stop(children)
    print("streamrl launch local: stopped; continue with the same command and --resume", file=sys.stderr)
    return 130
  finally:
    _kill_leftovers(children)
    signal.signal(signal.SIGTERM, previous)


def _write_manifest(workdir: Path, children: list[Child]) -> None:
  """WORKDIR/launch.json: each child's name, pid, cores and log."""
  (workdir / "launch.json").write_text(json.dumps(
      [dict(name=c.name, pid=c.proc.pid, cores=c.cores, log=str(c.log) if c.log else None) for c in children],
      indent=2))


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt


def _supervise(children: list[Child], trainer_processes: int, restarts: int = 0, on_restart=None) -> int:
  """Waits for the trainer. A sampler that fails is started again while `restarts` last; a trainer process
  that fails, or a sampler beyond them, stops the run (its exit code is returned)."""
  trainers, samplers = children[:trainer_processes], children[trainer_processes:]
  while any(c.proc.poll() is None for c in trainers):
    for child in children:
      code = child.proc.poll()
      if code in (None, 0):
        continue
      said = f"streamrl launch local: {child.name} exited with code {code}"
      if child in samplers and restarts > 0:
        restarts -= 1
        print(f"{said}; starting it again ({restarts} restart(s) left)", file=sys.stderr, flush=True)
        child.start()
        if on_restart is not None:
          on_restart()
        continue
      print(said + (f"; the end of its log ({child.log}):\n{_tail(child.log)}" if child.log else ""), file=sys.stderr)
      _stop(children)
      return code
    time.sleep(0.2)
  deadline = time.monotonic() + SAMPLER_EXIT_GRACE_S
  while any(c.proc.poll() is None for c in samplers) and time.monotonic() < deadline:
    time.sleep(0.2)
  return trainers[0].proc.returncode


def _stop(children: list[Child]) -> None:
  """SIGINT to the trainer (it checkpoints and exits), SIGTERM to the rest; SIGKILL after the grace period."""
  for child in children:
    child.signal(signal.SIGINT if child.name.startswith("trainer") else signal.SIGTERM)
  deadline = time.monotonic() + STOP_GRACE_S
  try:
    while any(c.proc is not None and c.proc.poll() is None for c in children) and time.monotonic() < deadline:
      time.sleep(0.2)
  except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
    pass


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
