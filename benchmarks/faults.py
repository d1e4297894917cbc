"""Faults across processes: what a lost sampler and a joining one cost, and whether memory stays flat.

Run 1 (the demo task, async, a trainer and two sampler processes on loopback): at step KILL_AT one sampler
is killed (SIGKILL); at step JOIN_AT a new one is started; the run goes on to STEPS. `recovery_s` is the
time from the kill to the first sample of one of its prompts delivered by another sampler (the controller's
`re_leased_delivered` event; the kill is noticed after `ControllerConfig.lease_timeout_s`). Throughput is the
mean of the per-step `samples_per_s` before the kill, between the loss and the join, and from 5 s after the
joiner registered (its compile). `lost_samples` and `duplicate_trained` compare what the trainer trained with
the plan: every step must train exactly its prompts x group size samples, each (step, group, sample) once (the trainer
refuses to finish a step otherwise); `duplicates_dropped` counts copies that arrived and were not trained,
`groups_kept` the lost sampler's groups that had arrived and were not leased again.

Run 2 (a tiny model, RSS_STEPS steps, one sampler): `rss_growth_frac` is the growth of the larger of the
trainer's and the sampler's resident memory from the first tenth of the run (after its first 10 steps) to
the last tenth, with the queue's depth alongside. Prints one JSON object as its last line.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streamrl_jax.commands.launch_local import Child

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import size  # noqa: E402

STEPS, KILL_AT, JOIN_AT = size(40, 12), size(10, 3), size(20, 6)
WARMUP_STEPS = size(50, 0)  # quick: the RL steps start from the freshly initialised model
RUN = ("MeshConfig.sampler_devices=1", "MeshConfig.trainer_devices=1", f"JobConfig.warmup_steps={WARMUP_STEPS}",
       "JobConfig.eval_prompts=1", f"PipelineConfig.steps={STEPS}", "ControllerConfig.lease_timeout_s=4.0",
       "ControllerConfig.heartbeat_s=1.0")
RSS_STEPS = size(200, 20)
TINY = ("MeshConfig.sampler_devices=1", "MeshConfig.trainer_devices=1", "JobConfig.warmup_steps=0",
        "JobConfig.eval_prompts=1", "DemoModelConfig.hidden_size=32", f"PipelineConfig.steps={RSS_STEPS}",
        "PipelineConfig.prompts_per_step=4", "PipelineConfig.group_size=4", "PipelineConfig.max_new_tokens=16",
        "EngineConfig.num_slots=16", "PipelineConfig.max_new_tokens=16")


class Run:
  """A trainer and its samplers as processes (`commands.launch_local.Child`), logs in the workdir."""

  def __init__(self, workdir: Path, sets: tuple[str, ...]):
    self.workdir, self.children = workdir, {}
    workdir.mkdir(parents=True)
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.address = f"127.0.0.1:{s.getsockname()[1]}"
    self.config = ["--config", str(ROOT / "configs" / "demo_cpu.gin")] + [a for b in sets for a in ("--set", b)]

  def start(self, name: str) -> None:
    role = (["trainer", "--workdir", str(self.workdir), "--listen", self.address] if name == "trainer"
            else ["sampler", "--connect", self.address, "--name", name])
    child = Child(name, [sys.executable, "-m", "streamrl_jax.cli", *role, *self.config], None,
                  self.workdir / f"{name}.log")
    child.start()
    self.children[name] = child

  def metrics(self) -> list[dict]:
    path = self.workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def wait_step(self, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while len(self.metrics()) < step:
      trainer = self.children["trainer"].proc
      if trainer.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"step {step} not reached; trainer log:\n{(self.workdir / 'trainer.log').read_text()[-3000:]}")
      time.sleep(0.05)

  def finish(self, timeout: float = 600) -> dict:
    code = self.children["trainer"].proc.wait(timeout=timeout)
    if code:
      raise RuntimeError(f"trainer exited with {code}:\n{(self.workdir / 'trainer.log').read_text()[-3000:]}")
    return json.loads((self.workdir / "summary.json").read_text())["counters"]

  def kill_all(self) -> None:
    for child in self.children.values():
      child.signal(signal.SIGKILL)


def loss_and_join(workdir: Path) -> dict:
  run = Run(workdir, RUN)
  try:
    run.start("trainer")
    run.start("s0")
    run.start("s1")
    run.wait_step(KILL_AT)
    killed_at = time.time()
    run.children["s1"].signal(signal.SIGKILL)
    run.wait_step(JOIN_AT)
    joined_at = time.time()
    run.start("s2")
    counters = run.finish()
  finally:
    run.kill_all()
  events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
  lost = next(e for e in events if e["event"] == "sampler_lost")
  delivered = [e for e in events if e["event"] == "re_leased_delivered" and e["t"] > killed_at]
  first_from_joiner = min((e["t"] for e in events if e["event"] == "sampler_joined" and e["sampler"] == "s2"),
                          default=math.inf)  # inf: the run ended before the joiner registered
  metrics = run.metrics()

  def rate(lo: float, hi: float) -> float | None:
    """Mean samples/s of the steps (after the first two) that ended between epoch seconds lo and hi."""
    chosen = [m["samples_per_s"] for m in metrics[2:] if lo <= m["time"] <= hi]
    return round(float(np.mean(chosen)), 2) if chosen else None

  return dict(
      recovery_s=round(delivered[0]["t"] - killed_at, 2) if delivered else None,
      loss_detected_s=round(lost["t"] - killed_at, 2),
      samples_per_s_before=rate(0, killed_at),
      samples_per_s_during_loss=rate(lost["t"], joined_at),
      samples_per_s_after_join=rate(first_from_joiner + 5.0, float("inf")),
      lost_samples=int(counters["samples_planned"] - counters["samples_trained"]),
      duplicate_trained=int(counters["samples_trained"] - counters["unique_samples_trained"]),
      duplicates_dropped=counters["duplicate_samples"], late_samples=counters["late_samples"],
      re_leased_leases=counters["re_leased_leases"], re_leased_prompts=counters["re_leased_prompts"],
      groups_kept=counters["groups_kept"],
      samplers_lost=counters["samplers_lost"], steps_trained=len(metrics))


def flat_memory(workdir: Path) -> dict:
  run = Run(workdir, TINY)
  try:
    run.start("trainer")
    run.start("s0")
    run.finish()
  finally:
    run.kill_all()
  metrics = run.metrics()
  tenth = max(1, RSS_STEPS // 10)
  early, late = metrics[10:10 + tenth], metrics[-tenth:]
  out = {}
  for key in ("rss_mb", "sampler_rss_mb"):
    a, b = np.mean([m[key] for m in early]), np.mean([m[key] for m in late])
    out[key] = dict(early=round(float(a), 1), late=round(float(b), 1), growth_frac=round(float(b / a - 1), 4))
  return dict(rss_growth_frac=max(v["growth_frac"] for v in out.values()), rss=out, rss_steps=len(metrics),
              queue_max_depth=max(m["queue_max_depth"] for m in metrics))


def main() -> None:
  os.environ["XLA_FLAGS"] = ""  # each program forces its own host devices
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    faults = loss_and_join(tmp / "faults")
    print("loss and join", faults, flush=True)
    memory = flat_memory(tmp / "memory")
    print("memory", memory, flush=True)
  print(json.dumps(dict(**faults, **memory, steps=STEPS, kill_at_step=KILL_AT, join_at_step=JOIN_AT)))


if __name__ == "__main__":
  main()
