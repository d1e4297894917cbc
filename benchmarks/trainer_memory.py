"""The trainer alone on one RL step's shape, in a process of its own: `python benchmarks/trainer_memory.py VARIANT`
prints that variant's peak RSS, steady step, tokens per call and MFU as one JSON object (`real_model.py`'s memory
part runs every variant; `lora.py` takes its step batches)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, by module name

MODEL = "smollm2-135m-instruct"


def peak_rss_mb() -> float:
  """This process's peak resident memory so far."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
  """This process's resident memory now (VmRSS)."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  return 0.0


QWEN05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
               num_kv_heads=2, qkv_bias=True, tie_embeddings=True, rope_theta=1e6, architecture="qwen2")
MEMORY_VARIANTS = {  # name: (model, TrainerConfig, prompts x samples, prompt tokens, new tokens, steps)
    "smollm2": ("smollm2", dict(logprob_chunk=8192), (8, 8), 47, 48, 3),
    "smollm2_unchunked": ("smollm2", dict(logprob_chunk=0), (8, 8), 47, 48, 3),
    "smollm2_remat": ("smollm2", dict(logprob_chunk=8192, remat="layer"), (8, 8), 47, 48, 2),
    "qwen05b": ("qwen05b", dict(logprob_chunk=8192), (4, 8), 32, 256, 1)}


def step_batch(rng, vocab: int, samples: int, length: int, prompt_len: int, new: int) -> tuple:
  """(lengths, a trainer batch) of one RL step's shape: random tokens, prompts of `prompt_len`, completions of
  new // 8 (at least 4) to `new` tokens, rows padded to `length`."""
  import numpy as np

  lengths = prompt_len + rng.integers(max(4, new // 8), new + 1, samples)
  valid = np.arange(length)[None, :] < lengths[:, None]
  return lengths, dict(tokens=rng.integers(3, vocab, (samples, length)).astype(np.int32), valid=valid,
                       loss_mask=valid & (np.arange(length)[None, :] >= prompt_len),
                       advantages=rng.normal(size=samples).astype(np.float32),
                       logprobs=np.full((samples, length), -2.0, np.float32))


def timed_step(batcher, state, batch) -> tuple:
  """One RL step's accumulation and update of `batch` through `batcher` (a `MicroBatcher`): (state, seconds)."""
  import jax

  start = time.perf_counter()
  state = batcher.add(state, batch)
  state, _ = batcher.finish(state)
  jax.block_until_ready(state.params)
  return state, time.perf_counter() - start


def memory_variant(name: str) -> dict:
  from streamrl_jax.cli import force_host_devices
  from streamrl_jax.host_memory import limit_fragmentation

  limit_fragmentation()  # as `streamrl` sets the allocator at its start
  force_host_devices(2)  # as the shipped config runs: one device per core, the trainer on one of them
  import jax
  import numpy as np
  from flax import nnx

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.models import ModelConfig, Transformer, load_hf
  from streamrl_jax.models.catalog import fetch
  from streamrl_jax.training import MicroBatcher, ObjectiveConfig, OptimizerConfig, Scoring, Trainer, TrainerConfig
  from streamrl_jax.training.trainer import compiled_memory
  from streamrl_jax.training.packing import auto_budget, chunk_tokens_for

  model_name, settings, (prompts, group), prompt_len, new, steps = MEMORY_VARIANTS[name]
  model = (load_hf(fetch(MODEL)) if model_name == "smollm2"
           else Transformer(ModelConfig(**QWEN05B), rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  config = model.config
  del model
  device = jax.devices()[-1]
  mesh = mesh_from_devices([device], MeshShape(1, 1, 1))
  trainer_config = TrainerConfig(**settings)
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=3e-6), ObjectiveConfig(objective="ppo"), mesh,
                    scoring=Scoring(0.8), config=trainer_config)
  length = -(-(prompt_len + new) // 8) * 8
  samples = prompts * group
  budget = auto_budget(config, length, trainer_config)  # the CPU's default, as the pipeline's trainer takes it
  chunk_tokens = chunk_tokens_for(config, length, samples * length, budget, trainer_config)
  batcher = MicroBatcher(trainer, pack_length=length, chunk_tokens=chunk_tokens)
  state = trainer.init_state(params)
  del params
  rss = {"state": round(rss_mb())}
  compile_start = time.perf_counter()
  state = trainer.precompile_packed(state, chunk_tokens, length)
  compile_s = time.perf_counter() - compile_start
  rss.update(compiled=round(rss_mb()), compile_peak=round(peak_rss_mb()))
  rng = np.random.default_rng(0)
  from peak import Peak

  peak = Peak(device)
  peak.measure()
  times, flops = [], []
  for _ in range(steps):
    lengths, batch = step_batch(rng, config.vocab_size, samples, length, prompt_len, new)
    state, seconds = timed_step(batcher, state, batch)
    times.append(seconds)
    flops.append(3.0 * sum(config.flops_per_token(t + 1) for n in lengths for t in range(int(n))))
  peak.measure()
  rss["steps"] = round(rss_mb())
  steady = slice(1, None) if steps > 1 else slice(None)
  step_s = float(np.mean(times[steady]))
  temp = compiled_memory(trainer, state, chunk_tokens // length, length)["temp"]
  return {"trainer_peak_rss_mb": round(peak_rss_mb()), "train_step_s": round(step_s, 2),
          "train_mfu": round(peak.mfu(float(np.mean(flops[steady])) / step_s), 3),
          "peak_gflops": round(peak.flops / 1e9, 1),
          "tokens_per_call": chunk_tokens, "call_temp_mb": round(temp / 2**20), "compile_s": round(compile_s, 1),
          "params": config.param_count(), "samples": samples, "length": length, "rss_mb": rss}


if __name__ == "__main__":
  if len(sys.argv) != 2 or sys.argv[1] not in MEMORY_VARIANTS:
    sys.exit(f"usage: trainer_memory.py VARIANT, one of {sorted(MEMORY_VARIANTS)}")
  print(json.dumps(memory_variant(sys.argv[1])))
