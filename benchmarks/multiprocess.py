"""The four run modes with the trainer and the sampler as separate programs, and weights over Arrow Flight.

`disaggregated`, `stream` and `async` run as `streamrl launch local --pin-cores`: the trainer on one CPU core,
one sampler on the other, each a process with one host device, joined by Arrow Flight on loopback.
`colocated` runs as `streamrl train`: one process on both cores (the verl-like baseline). Every mode starts
from the same warmed-up model (supervised warm-up done once here) with the same seed and runs STEPS steps of
128 samples; the first SKIP steps (compiles, the pipeline filling) are left out of the rates.

The workload is picked so that the two stages take similar time, the condition the resource-split policy
creates on a cluster by choosing device counts; here the devices are fixed (a core each), so the workload
moves instead: long-tailed arithmetic of up to 8 digits (most answers short, a few long, as in RL) on a
decoder of hidden size 160, 128 engine slots, 8 decode steps per host round trip. Measured in disaggregated
runs on this machine (after batched prefill), hidden sizes 160, 192 and 224 gave generation / training per
step of about 0.79, 0.73 and 0.61; 160 is the closest to 1 that keeps training the longer stage, so the
trainer (the stage the modes exist to keep busy) is the one the others must feed. `stage_seconds` below
reports the balance of this run.

Weights: a ~100M-parameter set of float32 tensors published by a weights-only Flight server in another
process and fetched by DoGet with a sampler's parallel streams (`FlightConfig.weight_streams`; chunks reassembled on
the host), against a host copy of the same bytes into a
fresh buffer (what a receiver must do) in the same run. Prints one JSON object as its last line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import size  # noqa: E402

STEPS, SKIP = size(10, 4), size(3, 2)
# quick: no supervised warm-up, so no warm-up run; every mode starts from the same freshly initialised model
WARMUP_STEPS = size(100, 0)
# quick: no colocated baseline (async_vs_colocated has no goal here; pipeline.py's has)
MODES = size(("disaggregated", "stream", "async", "colocated"), ("disaggregated", "async"))  # quick: the goals' own
WORKLOAD = ("DemoModelConfig.hidden_size=160", "TaskConfig.max_digits=8", f"JobConfig.warmup_steps={WARMUP_STEPS}",
            "JobConfig.eval_prompts=1", "EngineConfig.num_slots=128", "EngineConfig.steps_per_sync=8",
            f"PipelineConfig.steps={STEPS}", "TrainerConfig.precompile=True", "MeshConfig.sampler_devices=0",
            "MeshConfig.trainer_devices=0")
WEIGHT_PARAMS = size(100_000_000, 25_000_000)
FETCHES = size(3, 4)  # fetches (and copies) timed, the fastest kept: cheap at the quick size, and steadier


def streamrl(*args: str, host_devices: int | None = None, workload: tuple[str, ...] = WORKLOAD) -> list[str]:
  head = [sys.executable, "-m", "streamrl_jax.cli"] + ([f"--host-devices={host_devices}"] if host_devices else [])
  sets = [a for s in workload for a in ("--set", s)]
  return head + list(args) + ["--config", str(ROOT / "configs" / "demo_cpu.gin")] + sets


def run_mode(mode: str, workdir: Path, warm: Path | None) -> list[dict]:
  workdir.mkdir(parents=True)
  if warm is not None:
    (workdir / "warmup_model").symlink_to(warm)
  if mode == "colocated":
    argv = streamrl("train", "--workdir", str(workdir), "--set", "PipelineConfig.mode='colocated'", host_devices=1)
  else:
    argv = streamrl("launch", "local", "--workdir", str(workdir), "--pin-cores", "--set",
                    f"PipelineConfig.mode='{mode}'")
  done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"{mode} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def warm_up(directory: Path, workload: tuple[str, ...] = WORKLOAD) -> Path:
  """The warm-up that `streamrl train` would do, once, saved where every mode's workdir links to it."""
  done = subprocess.run(streamrl("train", "--workdir", str(directory), "--set", "PipelineConfig.steps=1",
                                 "--set", "PipelineConfig.mode='colocated'", host_devices=1, workload=workload),
                        capture_output=True, text=True, timeout=900, env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"warm-up failed:\n{done.stderr[-3000:]}")
  return directory / "warmup_model"


def serve_weights(ready, stop) -> None:
  """A weights-only trainer server holding one published version of ~WEIGHT_PARAMS float32 parameters."""
  import jax.numpy as jnp

  from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
  rng = np.random.default_rng(0)
  per = WEIGHT_PARAMS // 24 // 1024 * 1024
  params = {f"layer_{i:02d}": jnp.asarray(rng.standard_normal(per, np.float32).reshape(-1, 1024)) for i in range(24)}
  store = HostWeightStore()
  store.publish(params, 1)
  store.wait()
  server = TrainerFlightServer("127.0.0.1", 0, controller=None, samples=None, weights=store, limits=ServerLimits(1))
  ready.put(server.address)
  stop.wait()
  server.shutdown()


def _address(ready, server) -> str:
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and server.is_alive():
    try:
      return ready.get(timeout=1)
    except Exception:  # queue.Empty
      continue
  raise RuntimeError(f"the weights server did not start (exit code {server.exitcode})")


def weight_transfer(streams: int | None = None) -> dict:
  """A version fetched over Flight with `streams` parallel DoGets (default: `FlightConfig.weight_streams`, what a
  sampler uses) against a copy of the same bytes into a fresh buffer."""
  from streamrl_jax.streaming.flight_config import FlightConfig
  from streamrl_jax.streaming.flight_client import FlightConnection, fetch_weights
  streams = streams or FlightConfig().weight_streams
  ctx = multiprocessing.get_context("spawn")
  ready, stop = ctx.Queue(), ctx.Event()
  server = ctx.Process(target=serve_weights, args=(ready, stop), daemon=True)
  server.start()
  try:
    connection = FlightConnection(_address(ready, server), timeout_s=120, retry_s=30)
    flight_s, copy_s, prefaulted_s, nbytes = [], [], [], 0
    for _ in range(FETCHES):
      start = time.perf_counter()
      _, flat, nbytes = fetch_weights(connection, 1, streams=streams)
      flight_s.append(time.perf_counter() - start)
      source = np.concatenate([a.reshape(-1) for a in flat.values()])
      del flat
      start = time.perf_counter()
      copy = source.copy()  # into a fresh buffer, as a receiver must
      copy_s.append(time.perf_counter() - start)
      start = time.perf_counter()
      np.copyto(copy, source)  # into pages already touched
      prefaulted_s.append(time.perf_counter() - start)
      del copy, source
    connection.client.close()
  finally:
    stop.set()
    server.join(timeout=30)
  gbps = lambda seconds: round(nbytes / min(seconds) / 1e9, 3)  # noqa: E731
  return dict(weight_transfer_gbps=gbps(flight_s), memcpy_gbps=gbps(copy_s), memcpy_prefaulted_gbps=gbps(prefaulted_s),
              weight_bytes=nbytes, weight_streams=streams)


def main() -> dict:
  out = {k: {} for k in ("samples_per_s", "trainer_idle_frac", "sampler_idle_frac", "step_s", "generation_s",
                         "train_s")}
  with tempfile.TemporaryDirectory(prefix="streamrl-multiprocess-") as tmp:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tmp) / "xla"))  # compiles shared by the runs
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    warm = warm_up(Path(tmp) / "warm") if WARMUP_STEPS else None
    for mode in MODES:
      steady = run_mode(mode, Path(tmp) / mode, warm)[SKIP:]
      samples = sum(m["samples_per_s"] * m["step_s"] for m in steady)
      out["samples_per_s"][mode] = round(samples / sum(m["step_s"] for m in steady), 2)
      for key in ("trainer_idle_frac", "sampler_idle_frac", "step_s", "generation_s", "train_s"):
        out[key][mode] = round(float(np.mean([m[key] for m in steady])), 3)
      print(mode, {k: v[mode] for k, v in out.items()}, file=sys.stderr, flush=True)
  rate = out["samples_per_s"]
  out.update(stream_vs_disaggregated=round(rate["stream"] / rate["disaggregated"], 3) if "stream" in rate else None,
             async_vs_disaggregated=round(rate["async"] / rate["disaggregated"], 3),
             async_vs_colocated=round(rate["async"] / rate["colocated"], 3) if "colocated" in rate else None,
             stage_seconds=dict(generation=out["generation_s"]["disaggregated"], training=out["train_s"]["disaggregated"]),
             **weight_transfer(), workload=list(WORKLOAD), steps=STEPS, skipped_steps=SKIP, samples_per_step=128)
  out["weight_vs_memcpy"] = round(out["weight_transfer_gbps"] / out["memcpy_gbps"], 3)
  if "stream" not in MODES:  # a quick run: stream's figure is a full run's
    out["quick_omits"] = ["stream_vs_disaggregated"]
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
