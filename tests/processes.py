"""Programs as processes in tests: a tiny run config, `streamrl launch local`, waits with timeouts, clean-up."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from safetensors.numpy import load_file

from tests.xla_flags import xla_flags


TINY = """
PipelineConfig.steps = {steps}
PipelineConfig.prompts_per_step = 4
PipelineConfig.group_size = 2
PipelineConfig.max_new_tokens = 8
PipelineConfig.mode = '{mode}'
PipelineConfig.seed = 3
EngineConfig.num_slots = 4
EngineConfig.max_prompt_length = 16
EngineConfig.min_prefill_bucket = 16
MeshConfig.sampler_devices = 1
MeshConfig.trainer_devices = {trainer_devices}
JobConfig.warmup_steps = 0
JobConfig.eval_prompts = 2
DemoModelConfig.hidden_size = 32
ControllerConfig.heartbeat_s = 0.5
"""


TIMEOUT_S = 240


def write_config(path: Path, steps: int = 2, trainer_devices: int = 1, mode: str = "stream") -> str:
  path.write_text(TINY.format(steps=steps, trainer_devices=trainer_devices, mode=mode))
  return str(path)


def launch(workdir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
  """`streamrl launch local` in a process of its own; `env` adds variables (fault injection)."""
  return _streamrl("launch", "local", "--workdir", str(workdir), *args, env=env)


def train(workdir: Path, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
  """`streamrl train` (sampler and trainer in one process) in a process of its own."""
  return _streamrl("train", "--workdir", str(workdir), *args, env=env, cwd=cwd)


def _streamrl(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": xla_flags(), **(env or {})}  # each program forces its own host devices
  return subprocess.Popen([sys.executable, "-m", "streamrl_jax.cli", *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=cwd)


def children_of(workdir: Path) -> list[int]:
  path = workdir / "launch.json"
  return [c["pid"] for c in json.loads(path.read_text())] if path.exists() else []


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def finish(proc: subprocess.Popen, workdir: Path, timeout: float = TIMEOUT_S) -> tuple[int, str]:
  """Waits for the launcher; on any failure kills it and every child it started."""
  try:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out
  finally:
    for pid in [proc.pid] + children_of(workdir):
      if alive(pid):
        os.kill(pid, signal.SIGKILL)


def metrics(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def final_weights(workdir: Path) -> dict:
  return load_file(str(workdir / "final_model" / "model.safetensors"))


# ---- a run's trainer and sampler programs, started and killed one by one (tests/test_faults.py) -----------
FAULTS = TINY + """
ControllerConfig.lease_timeout_s = 3.0
FlightConfig.connect_retry_s = 120.0
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Programs:
  """Trainer and sampler processes of one run, each logging to a file; `kill_all` leaves none behind."""

  def __init__(self, workdir: Path, steps: int, mode: str):
    self.workdir, self.procs, self.logs = workdir, {}, {}
    self.config = workdir / "faults.gin"
    self.config.write_text(FAULTS.format(steps=steps, trainer_devices=1, mode=mode))
    self.address = f"127.0.0.1:{free_port()}"

  def start(self, role: str, name: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    args = (["trainer", "--workdir", str(self.workdir), "--listen", self.address] if role == "trainer"
            else ["sampler", "--connect", self.address, "--name", name])
    log = (self.workdir / f"{name}.log").open("a")
    proc = subprocess.Popen([sys.executable, "-m", "streamrl_jax.cli", *args, "--config", str(self.config), *extra],
                            env={**os.environ, "XLA_FLAGS": xla_flags(), **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    self.procs[name], self.logs[name] = proc, self.workdir / f"{name}.log"
    return proc

  def events(self) -> list[dict]:
    """The trainer's events so far (its events.jsonl; a line being written is left out)."""
    path = self.workdir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []

  def lost(self, name: str) -> bool:
    """Whether the trainer has declared sampler `name` lost."""
    return any(row.get("event") == "sampler_lost" and row.get("sampler") == name for row in self.events())

  def joined(self, name: str) -> int:
    """How many times sampler `name` has registered with the trainer."""
    return sum(row.get("event") == "sampler_joined" and row.get("sampler") == name for row in self.events())

  def steps_done(self) -> int:
    path = self.workdir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0

  def wait_until(self, condition, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      if time.monotonic() > deadline:
        raise TimeoutError(f"{what} did not happen within {timeout} s; logs:\n{self.tails()}")
      if self.procs["trainer"].poll() is not None and not condition():
        raise RuntimeError(f"the trainer exited ({self.procs['trainer'].returncode}) before {what}:\n{self.tails()}")
      time.sleep(0.1)

  def wait_exit(self, name: str, timeout: float = TIMEOUT_S) -> int:
    try:
      return self.procs[name].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      raise TimeoutError(f"{name} still running after {timeout} s; logs:\n{self.tails()}") from None

  def tails(self) -> str:
    return "\n".join(f"--- {name}\n{path.read_text()[-2500:]}" for name, path in self.logs.items())

  def kill_all(self) -> None:
    for proc in self.procs.values():
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def check_each_step_once(workdir: Path, steps: int, trainer_restarts: int = 0) -> dict:
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in metrics] == list(range(1, steps + 1))
  assert all(m["rss_mb"] > 0 and m["sampler_rss_mb"] > 0 for m in metrics)
  # The queue's depth now never exceeds its running maximum, which never falls within one trainer process (a
  # restarted trainer's queue starts empty); every sample passed through it.
  assert all(0 <= m["queue_depth"] <= m["queue_max_depth"] for m in metrics)
  maxima = [m["queue_max_depth"] for m in metrics]
  falls = sum(later < earlier for earlier, later in zip(maxima, maxima[1:]))
  assert falls <= trainer_restarts, maxima
  assert metrics[-1]["queue_max_depth"] >= 1
  counters = json.loads((workdir / "summary.json").read_text())["counters"]
  return counters
