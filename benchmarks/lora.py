"""LoRA against full fine-tuning: bytes per weight version, the trainer's steady step and peak memory, and the
held-out gain after equal RL steps. Arms in one run.

1. Sync, on SmolLM2-135M's shapes (random weights: only sizes matter): a version published through the trainer's
   weight store, fetched over Arrow Flight on loopback, placed on the sampler's device and finished there (LoRA:
   the adapters merged into the sampler's base). `lora_sync_bytes_ratio` = adapter bytes / full bytes (rank 16 on
   all seven projections); `<arm>_update_s` publish-to-usable seconds (best of VERSIONS, arms interleaved).
2. Train, on SmolLM2-135M-Instruct with the shipped RL config's work (`configs/smollm2_cpu.gin`: 8 prompts x 8
   samples, 47-token chat prompts, up to 48 new tokens, packed rows, log-probabilities over vocabulary chunks),
   each arm in its own process: `lora_train_step_ratio` (steady step, LoRA over full), `lora_peak_rss_ratio` (the
   trainer's peak RSS: the loaded model, the trainer's state, its compiles and steps; the count restarts once the
   model is loaded, and `<arm>_process_peak_rss_mb` gives the whole process's), the peaks of the compiles and of the
   steps apart (`lora_steps_peak_rss_ratio`), XLA's figures of one accumulation call (its arguments, temporaries and
   FLOPs: `lora_call_flops_ratio`).
3. Accuracy, on SmolLM2-135M-Instruct as shipped (about 15 min an arm here): `streamrl train --config
   configs/smollm2_cpu.gin` (full fine-tuning) and `--config configs/smollm2_lora_cpu.gin` (rank 16 on all seven
   projections, its own learning rate), equal steps, 200 held-out prompts; `lora_accuracy_gain_ratio` = LoRA's
   held-out gain over full's.

A quick run (`benchmarks/sizing.py`) runs the sync part and names the figures of the others in `quick_omits`. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402
from trainer_memory import peak_rss_mb, step_batch, timed_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RANK, ALPHA = 16, 32.0
LORA_SETS = (f"LoraConfig.rank={RANK}", f"LoraConfig.alpha={ALPHA}")
VERSIONS = size(3, 2)
TRAIN_STEPS = size(4, 3)  # trainer steps per arm (the first, compiling, is not counted; `--part train` quick: 3)
TRAIN_PROMPTS = size(8, 2)  # prompts of 8 samples per trainer step (`--part train` quick: a quarter of the shipped config's)
ACCURACY_ARMS = {"full": Path("configs/smollm2_cpu.gin"), "lora": Path("configs/smollm2_lora_cpu.gin")}


def _reset_peak_rss() -> bool:
  """Starts the kernel's peak-RSS count (VmHWM) afresh; False where /proc/self/clear_refs refuses."""
  try:
    Path("/proc/self/clear_refs").write_text("5")
    return True
  except OSError:
    return False


def _hwm_mb() -> float:
  """The peak RSS since the last reset (VmHWM of /proc/self/status), else the process's whole peak."""
  try:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  except (OSError, ValueError):
    pass
  return peak_rss_mb()


def part_sync() -> dict:
  import jax
  from flax import nnx

  from streamrl_jax.meshes import single_device_mesh
  from streamrl_jax.models import Transformer, lora
  from streamrl_jax.models.precision import SamplerPrecision, landing
  from streamrl_jax.streaming.flight_client import FlightConnection
  from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
  from precision import SMOLLM2_SHAPE, timed_update

  config = lora.LoraConfig(rank=RANK, alpha=ALPHA)
  graphdef, params = nnx.split(Transformer(SMOLLM2_SHAPE, rngs=nnx.Rngs(0)))
  _, adapters, _ = lora.adapt(graphdef, params, config)
  mesh = single_device_mesh(jax.devices()[0])
  precision = SamplerPrecision(quantize_on="sampler")  # a LoRA run's: float32 adapters, merged on the sampler
  arms = {"full": (params, landing(params, SamplerPrecision(), mesh)),
          "lora": (adapters, landing(adapters, precision, mesh, base=params, lora_scale=config.scale))}
  stores = {name: HostWeightStore(precision=SamplerPrecision()) for name in arms}
  servers = {name: TrainerFlightServer("127.0.0.1", 0, controller=None, samples=None, weights=store,
                                       limits=ServerLimits(1))
             for name, store in stores.items()}
  seconds, nbytes = {name: [] for name in arms}, {}
  try:
    connections = {name: FlightConnection(s.address, timeout_s=120, retry_s=30) for name, s in servers.items()}
    for version in range(VERSIONS):
      for name, (published, land) in arms.items():
        seconds_taken, nbytes[name] = timed_update(stores[name], connections[name], land, published, version)
        seconds[name].append(seconds_taken)
    for connection in connections.values():
      connection.client.close()
  finally:
    for server in servers.values():
      server.shutdown()
  return dict(lora_sync_bytes_ratio=round(nbytes["lora"] / nbytes["full"], 4), full_bytes=nbytes["full"],
              lora_bytes=nbytes["lora"], full_update_s=round(min(seconds["full"]), 3),
              lora_update_s=round(min(seconds["lora"]), 3),
              lora_update_ratio=round(min(seconds["lora"]) / min(seconds["full"]), 3))


def train_arm(arm: str) -> dict:
  """One arm's trainer on SmolLM2 (run in its own process by `part_train`)."""
  from streamrl_jax.cli import force_host_devices
  from streamrl_jax.host_memory import limit_fragmentation

  limit_fragmentation()
  force_host_devices(2)  # as the shipped config runs: one device per core, the trainer on one of them
  import jax
  import numpy as np
  from flax import nnx

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.models import load_hf, lora
  from streamrl_jax.models.catalog import fetch
  from streamrl_jax.training import MicroBatcher, ObjectiveConfig, OptimizerConfig, Scoring, Trainer, TrainerConfig
  from streamrl_jax.training.trainer import compiled_memory
  from streamrl_jax.training.packing import auto_budget, chunk_tokens_for

  mesh = mesh_from_devices([jax.devices()[-1]], MeshShape(1, 1, 1))
  model = load_hf(fetch("smollm2-135m-instruct"), mesh=mesh)  # on the trainer's device: placing copies nothing
  config = model.config
  graphdef, params = nnx.split(model)
  del model
  load_peak = peak_rss_mb()
  reset = _reset_peak_rss()  # the trainer's peak from here: its state, compiles and steps (the model stays loaded)
  base = None
  if arm == "lora":
    graphdef, params, base = lora.adapt(graphdef, params, lora.LoraConfig(rank=RANK, alpha=ALPHA))
  trainer_config = TrainerConfig(logprob_chunk=8192)
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=3e-6), ObjectiveConfig(objective="ppo"), mesh,
                    scoring=Scoring(0.8, base_params=base), config=trainer_config)
  prompts, group, prompt_len, new = TRAIN_PROMPTS, 8, 47, 48
  length, samples = -(-(prompt_len + new) // 8) * 8, prompts * group
  chunk_tokens = chunk_tokens_for(config, length, samples * length, auto_budget(config, length, trainer_config),
                                  trainer_config)
  batcher = MicroBatcher(trainer, pack_length=length, chunk_tokens=chunk_tokens)
  state = trainer.init_state(params)
  del params, base
  state = trainer.precompile_packed(state, chunk_tokens, length)
  compiled_peak = _hwm_mb()
  _reset_peak_rss()  # the steps' own peak (the compiles' temporaries gone)
  rng = np.random.default_rng(0)
  times = []
  for _ in range(TRAIN_STEPS):
    _, batch = step_batch(rng, config.vocab_size, samples, length, prompt_len, new)
    state, seconds = timed_step(batcher, state, batch)
    times.append(seconds)
  trained = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  steps_peak = _hwm_mb()
  memory = compiled_memory(trainer, state, chunk_tokens // length, length)  # XLA's view of one accumulation call
  return dict(train_step_s=round(float(np.mean(times[1:])), 3), peak_rss_mb=round(max(compiled_peak, steps_peak)),
              peak_rss_reset=reset, compile_peak_rss_mb=round(compiled_peak), steps_peak_rss_mb=round(steps_peak),
              call_gflops=round(memory["flops"] / 1e9, 1),
              process_peak_rss_mb=round(peak_rss_mb()), load_peak_rss_mb=round(load_peak), trained_params=trained,
              call_arguments_mb=round(memory["argument"] / 2**20), call_temp_mb=round(memory["temp"] / 2**20),
              steps=len(times) - 1)


def part_train() -> dict:
  out = {}
  for arm in ("full", "lora"):
    print(f"lora: trainer arm {arm} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--train-arm", arm], stdout=subprocess.PIPE, text=True,
                          timeout=1800, env=dict(os.environ, XLA_FLAGS=""))
    if done.returncode:
      raise RuntimeError(f"trainer arm {arm} failed (exit {done.returncode})")
    out.update({f"{arm}_{k}": v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()})
  out["lora_train_step_ratio"] = round(out["lora_train_step_s"] / out["full_train_step_s"], 3)
  if not (out["full_peak_rss_reset"] and out["lora_peak_rss_reset"]):  # the peaks would include the model's load
    raise RuntimeError("/proc/self/clear_refs refused: the trainer's own peak RSS cannot be told from the load's")
  out["lora_peak_rss_ratio"] = round(out["lora_peak_rss_mb"] / out["full_peak_rss_mb"], 3)
  out["lora_steps_peak_rss_ratio"] = round(out["lora_steps_peak_rss_mb"] / out["full_steps_peak_rss_mb"], 3)
  out["lora_call_flops_ratio"] = round(out["lora_call_gflops"] / out["full_call_gflops"], 3)
  return out


def rl_arm(workdir: Path, config: Path) -> dict:
  """`streamrl train --config CONFIG` as shipped, in a process of its own: held-out accuracy before and after."""
  command = [sys.executable, "-m", "streamrl_jax.cli", "train", "--config", str(config), "--workdir", str(workdir)]
  done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT,
                        env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"streamrl train --config {config} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  return dict(accuracy_before=summary["accuracy_before"], accuracy_after=summary["accuracy_after"],
              gain=round(summary["accuracy_after"] - summary["accuracy_before"], 4), rl_seconds=summary["rl_seconds"],
              steps=summary["steps"])


def part_accuracy() -> dict:
  """SmolLM2-135M-Instruct's RL run as shipped, full fine-tuning (configs/smollm2_cpu.gin) and LoRA
  (configs/smollm2_lora_cpu.gin: rank 16 on all seven projections, its own learning rate), equal steps and
  held-out prompts: `lora_accuracy_gain_ratio` = LoRA's gain over full's."""
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, config in ACCURACY_ARMS.items():
      print(f"lora: RL arm {name} ({config.name}) ...", file=sys.stderr, flush=True)
      out.update({f"{name}_{k}": v for k, v in rl_arm(Path(tmp) / name, ROOT / config).items()})
  out["lora_accuracy_gain_ratio"] = round(out["lora_gain"] / out["full_gain"], 3) if out["full_gain"] > 0 else None
  return out


PARTS = {"sync": part_sync, "train": part_train, "accuracy": part_accuracy}
PART_FIGURES = {"train": ("lora_train_step_ratio", "lora_peak_rss_ratio"), "accuracy": ("lora_accuracy_gain_ratio",)}
QUICK_PARTS = ("sync",)  # a quick run's: the trainer arms and the RL arms are minutes each; their figures a full run's


def main(parts) -> dict:
  out = dict(rank=RANK, alpha=ALPHA, quick=QUICK)
  if QUICK:
    out["quick_omits"] = [f for part, figures in PART_FIGURES.items() if part not in parts for f in figures]
  for part in parts:
    start = time.perf_counter()
    out.update(PARTS[part]())
    out[f"{part}_s"] = round(time.perf_counter() - start, 1)
  return out


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--part", action="append", choices=sorted(PARTS), help="parts to run (default: all)")
  parser.add_argument("--train-arm", choices=("full", "lora"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.train_arm:
    print(json.dumps(train_arm(args.train_arm)))
  else:
    print(json.dumps(main(args.part or list(QUICK_PARTS if QUICK else PARTS))))
