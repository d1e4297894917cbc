"""A trainer of 1, 2 and 4 processes with 2 samplers on this machine: what process 0 carries (DistFlow's question).

Each run is `streamrl launch local --trainer-processes P --samplers 2` of the same work: the CPU demo's decoder
(no warm-up: what crosses the doors does not depend on it), 16 prompts x 8 samples a step, up to 64 new tokens,
async mode; the trainer's 4 host devices split between its processes, a device per sampler; no core pinning (more
processes than cores). Every trainer process takes its own groups' samples at its own Flight door; process 0 also
receives the other processes' rows described (never their tokens) and their doors' `Delivery` questions (control
messages, not counted as sample bytes).

Figures, from each run's summary counters:
- `leader_sample_bytes_frac`: sample bytes received by process 0 (its door's Arrow batches, plus the other
  processes' row descriptions) over all sample bytes the trainer's doors took, at 4 processes (goal <= 1/4 + 0.02);
  and by process count.
- `leader_weight_bytes_frac`: weight bytes process 0 sent to samplers over all the trainer's processes sent (each
  process serves its own pieces of every version), at 4 processes (goal <= 0.27).
- `trainer_processes_step_ratio`: steady step seconds (median of the steps after the first two) with 4 processes
  over 1 (report: six processes share two cores here).
Prints one JSON object as its last line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import size  # noqa: E402

PROCESSES = (1, 2, 4)
STEPS = size(8, 5)
WORKLOAD = ("JobConfig.warmup_steps=0", "JobConfig.eval_prompts=1", f"PipelineConfig.steps={STEPS}",
            "PipelineConfig.mode='async'", "PipelineConfig.prompts_per_step=16", "PipelineConfig.group_size=8",
            "PipelineConfig.max_new_tokens=64", "MeshConfig.trainer_devices=4", "MeshConfig.sampler_devices=1")


def run(processes: int, workdir: Path) -> tuple[dict, list[dict]]:
  """(the run's summary counters, its metrics rows)."""
  sets = [a for s in WORKLOAD for a in ("--set", s)]
  argv = [sys.executable, "-m", "streamrl_jax.cli", "launch", "local", "--workdir", str(workdir), "--samplers", "2",
          "--trainer-processes", str(processes), "--config", str(ROOT / "configs" / "demo_cpu.gin"), *sets]
  done = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"{processes} trainer processes failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                       f"{done.stderr[-3000:]}")
  counters = json.loads((workdir / "summary.json").read_text())["counters"]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return counters, rows


def carried(counters: dict, processes: int) -> dict:
  """What process 0 received of the samples, and what it sent of the weights, against the whole trainer's."""
  own = counters["flight_accepted_bytes"]
  doors = [own] + [counters.get(f"intake_door_kib/{p}", 0) << 10 for p in range(1, processes)]
  received = own + counters.get("intake_peer_description_bytes", 0)
  weights = ([counters.get(f"intake_weight_kib/{p}", 0) for p in range(processes)] if processes > 1
             else [counters["flight_weight_bytes"]])  # as the processes told each other at the last poll
  return dict(sample_bytes=sum(doors), door_bytes=doors, leader_received_bytes=received,
              leader_sample_bytes_frac=round(received / max(sum(doors), 1), 4),
              leader_weight_bytes_frac=round(weights[0] / max(sum(weights), 1), 4),
              samples_trained=counters["samples_trained"], duplicate_samples=counters["duplicate_samples"])


def main() -> dict:
  results = {}
  with tempfile.TemporaryDirectory(prefix="streamrl-distributed-") as tmp:
    for processes in PROCESSES:
      counters, rows = run(processes, Path(tmp) / f"p{processes}")
      steady = [r["step_s"] for r in rows[2:]] or [rows[-1]["step_s"]]
      results[processes] = dict(carried(counters, processes), step_s=round(statistics.median(steady), 3))
      print(f"{processes} trainer process(es): {json.dumps(results[processes])}", file=sys.stderr, flush=True)
  most = PROCESSES[-1]
  return dict(leader_sample_bytes_frac=results[most]["leader_sample_bytes_frac"],
              leader_weight_bytes_frac=results[most]["leader_weight_bytes_frac"],
              trainer_processes_step_ratio=round(results[most]["step_s"] / results[1]["step_s"], 3),
              by_processes={str(p): r for p, r in results.items()}, steps=STEPS, processes=list(PROCESSES))


if __name__ == "__main__":
  print(json.dumps(main()))
