"""Programs as processes in tests: a tiny run config, `streamrl launch local`, waits with timeouts, clean-up."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from safetensors.numpy import load_file


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
JobConfig.hidden_size = 32
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
  env = dict(os.environ, XLA_FLAGS="", **(env or {}))  # each program forces its own host devices
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
