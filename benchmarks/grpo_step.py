"""GRPO step speed on equal work, before and after packed sequences, with the default CPU device setting.

The setting of issue 12 (what Tunix's GRPO was timed on: 1.67 s per steady step on this kind of machine): a
Qwen-shaped decoder of 2.39M parameters (4 layers, hidden 256, MLP 512, 4 heads and 2 KV heads of 64,
vocabulary 64), 8 prompts x 8 samples per step, prompts of 8 tokens, 64 new tokens each (EOS off, so every
sample is 72 tokens), AdamW, no KL; 10 steps, the first two left out; the trainer's shapes compiled first
(`TrainerConfig.precompile`); the engine decodes 8 steps per host round trip (`EngineConfig.steps_per_sync`:
with EOS off nothing is lost to it). Modes colocated, stream and async on
`streamrl train`'s default devices (one per core), each with the trainer's packed rows (`packing`, the
default) and without (`chunk_rows` 8 padded to a power of two, as before). Then the same trainer on a
long-tailed length mix (most samples short, a few at the maximum), packed and not, timed alone.

`useful_train_mfu` counts the model FLOPs of real (unpadded) tokens, 3x the forward's matmuls and causal
attention, over the f32 matmul peak measured in the same run on the trainer's device (before and after, `peak.py`); `padding_frac` is the
share of the trainer's computed token slots that held padding. Prints one JSON object as its last line.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from streamrl_jax.cli import default_host_devices, force_host_devices


force_host_devices(default_host_devices())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer  # noqa: E402
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.runner import run_pipeline  # noqa: E402
from streamrl_jax.sampling import EngineConfig  # noqa: E402
from streamrl_jax.sampling import SamplerConfig  # noqa: E402
from streamrl_jax.training import MicroBatcher, ObjectiveConfig, OptimizerConfig, Trainer, TrainerConfig  # noqa: E402
from streamrl_jax.meshes import MeshShape, mesh_from_devices  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402
from sizing import QUICK, size  # noqa: E402

STEPS, SKIP = size(10, 3), size(2, 1)
PROMPT, NEW = 8, 64
MODES = size(("colocated", "stream", "async"), ("stream",))  # quick: the mode of the goals a quick run reports
PACKINGS = size((True, False), (True,))  # the pipeline runs' trainer packing (quick: packed, the goals')
# the trainer alone's runs, (mix, packing) (quick: the long-tailed mix packed, the goal's)
TRAINER_RUNS = size((("equal", True), ("equal", False), ("long_tail", True), ("long_tail", False)),
                    (("long_tail", True),))
TUNIX_STEP_S = 1.67
ALPHABET = "0123456789+-*/=()<>.,:;!? abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVW"[:61]
MODEL = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=64, qkv_bias=True)


class NoEOS:
  """The tokenizer with an end-of-sequence id no sample can hit: every sample runs to max_new_tokens."""

  def __init__(self, inner):
    self.inner, self.eos_id, self.pad_id, self.vocab_size = inner, -1, inner.pad_id, inner.vocab_size
    self.stop_ids = (-1,)

  def encode(self, text):
    return self.inner.encode(text)

  def encode_prompt(self, text):
    return self.inner.encode_prompt(text)

  def decode(self, ids):
    return self.inner.decode(ids)


class AddTask:
  """8-token prompts "ddd+ddd=" with a reward for the sum's digits appearing (enough variance for GRPO)."""

  def sample(self, rng):
    a, b = (int(x) for x in rng.integers(0, 1000, 2))
    return f"{a:03d}+{b:03d}=", str(a + b)

  def reward(self, prompt, completion):
    a, b = (int(x) for x in prompt[:-1].split("+"))
    return float(str(a + b) in completion)


def config_for(mode: str, packing: bool) -> PipelineConfig:
  # Every sample runs to max_new_tokens (EOS off), so 8 decode steps per host round trip lose nothing.
  engine = EngineConfig(num_slots=64, max_prompt_length=PROMPT, max_new_tokens=NEW, min_prefill_bucket=8,
                        steps_per_sync=8)
  return PipelineConfig(mode=mode, steps=STEPS, prompts_per_step=8, group_size=8, max_new_tokens=NEW,
                        staleness=1, sampler=SamplerConfig(engine=engine),
                        trainer=TrainerConfig(packing=packing, precompile=True,
                                              optimizer=OptimizerConfig(learning_rate=1e-5), objective=ObjectiveConfig()))


def train_flops(lengths) -> float:
  """3 x the forward FLOPs of each sample's real tokens (causal attention: token t attends to t keys)."""
  return 3.0 * sum(MODEL.flops_per_token(t + 1) for n in lengths for t in range(int(n)))


def pipeline_runs(params_host, graphdef, tokenizer, task) -> dict:
  out = {}
  for packing in PACKINGS:
    for mode in MODES:
      model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params_host))
      result = run_pipeline(config_for(mode, packing), model, tokenizer, task)
      steady = result.metrics[SKIP:]
      train_s = sum(m["train_s"] for m in steady)
      flops = train_flops([PROMPT + NEW] * 64) * len(steady)
      key = f"{mode}{'' if packing else '_unpacked'}"
      out[key] = dict(
          steady_step_s=float(np.mean([m["step_s"] for m in steady])),
          step_s_median=float(np.median([m["step_s"] for m in steady])),
          generation_s=float(np.mean([m["generation_s"] for m in steady])),
          train_s=train_s / len(steady), weight_sync_s=float(np.mean([m["weight_sync_s"] for m in steady])),
          trainer_idle_frac=float(np.mean([m["trainer_idle_frac"] for m in steady])),
          train_calls=float(np.mean([m["train_calls"] for m in steady])),
          train_tokens_per_s=sum(m["train_tokens"] for m in steady) / train_s,
          useful_train_flops_per_s=flops / train_s,
          padding_frac=float(np.mean([m["train_padding_frac"] for m in steady])))
      print(key, json.dumps({k: round(v, 4) for k, v in out[key].items()}), flush=True)
  return out


def with_mfu(runs: dict, peak: Peak) -> dict:
  """Each run's `useful_train_mfu`: its useful training FLOP/s over the peak measured around all of them."""
  return {k: dict(v, useful_train_mfu=peak.mfu(v["useful_train_flops_per_s"])) for k, v in runs.items()}


def long_tail_lengths(rng, samples: int = 64) -> np.ndarray:
  """Most samples short (prompt + 4..16 new tokens), one in eight at the maximum."""
  new = np.where(rng.random(samples) < 0.125, NEW, rng.integers(4, 17, samples))
  return PROMPT + new


def trainer_batch(rng, lengths) -> dict:
  width = PROMPT + NEW
  pos = np.arange(width)[None]
  valid = pos < np.asarray(lengths)[:, None]
  return dict(tokens=rng.integers(3, 64, (len(lengths), width)).astype(np.int32), valid=valid,
              loss_mask=valid & (pos >= PROMPT), advantages=rng.normal(size=len(lengths)).astype(np.float32),
              logprobs=np.full((len(lengths), width), -4.0, np.float32))


def trainer_runs(params_host, graphdef, device) -> dict:
  """The trainer alone on a step's samples: the equal-work mix and the long-tailed one, packed or not."""
  rng = np.random.default_rng(0)
  mixes = {"equal": [np.full(64, PROMPT + NEW)] * STEPS, "long_tail": [long_tail_lengths(rng) for _ in range(STEPS)]}
  mesh = mesh_from_devices([device], MeshShape(1, 1, 1))
  out = {}
  for mix, packing in TRAINER_RUNS:
    lengths_per_step = mixes[mix]
    trainer = Trainer(graphdef, OptimizerConfig(learning_rate=1e-5), ObjectiveConfig(), mesh)
    config = config_for("stream", packing)
    batcher = MicroBatcher(trainer, chunk_rows=config.trainer.chunk_rows, **(
        dict(pack_length=config.packed_length, chunk_tokens=64 * config.packed_length) if packing else {}))
    state = trainer.init_state(jax.tree.map(jnp.asarray, params_host))
    if packing:  # every shape compiled before the clock starts, as TrainerConfig.precompile does
      state = trainer.precompile_packed(state, batcher.chunk_tokens, batcher.pack_length)
    else:
      state = trainer.precompile(state, config.trainer.chunk_rows, PROMPT + NEW)
    seconds, flops, real, computed = 0.0, 0.0, 0, 0
    for step, lengths in enumerate(lengths_per_step):
      batch = trainer_batch(rng, lengths)
      before = dict(batcher.counters)
      start = time.perf_counter()
      state = batcher.add(state, batch)
      state, _ = batcher.finish(state)
      jax.block_until_ready(state.params)
      if step >= SKIP:
        seconds += time.perf_counter() - start
        flops += train_flops(lengths)
        real += batcher.counters["real_tokens"] - before["real_tokens"]
        computed += batcher.counters["computed_tokens"] - before["computed_tokens"]
    key = f"{mix}{'' if packing else '_unpacked'}"
    out[key] = dict(train_step_s=seconds / (STEPS - SKIP), train_tokens_per_s=real / seconds,
                    useful_train_flops_per_s=flops / seconds, padding_frac=1 - real / computed)
    print("trainer", key, json.dumps({k: round(v, 4) for k, v in out[key].items()}), flush=True)
  return out


def long_tail_figures(packed: dict, unpacked: dict | None) -> dict:
  """The long-tailed mix's figures; those against the unpacked trainer only where it ran (not in a quick run)."""
  out = dict(padding_frac=round(packed["padding_frac"], 3))
  if unpacked is not None:
    out.update(padding_frac_unpacked=round(unpacked["padding_frac"], 3))
  out.update(train_tokens_per_s=round(packed["train_tokens_per_s"], 1),
             useful_train_mfu=round(packed["useful_train_mfu"], 3))
  if unpacked is not None:
    out.update(packed_vs_unpacked_train_s=round(packed["train_step_s"] / unpacked["train_step_s"], 3))
  return out


def main() -> dict:
  if QUICK:  # shapes the runs share compile once (no compile falls in a timed step either way)
    cache = tempfile.mkdtemp(prefix="grpo-step-bench-cache-")
    atexit.register(shutil.rmtree, cache, True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  tokenizer, task = NoEOS(CharTokenizer(ALPHABET)), AddTask()
  assert tokenizer.vocab_size == MODEL.vocab_size
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  params_host = jax.tree.map(np.asarray, params)
  devices = jax.devices()
  peak = Peak(devices[-1])  # the trainer's device (in stream and async, the trainer's mesh is that one alone here)
  peak.measure()
  pipeline = pipeline_runs(params_host, graphdef, tokenizer, task)
  trainer = trainer_runs(params_host, graphdef, devices[-1])
  peak.measure()
  pipeline, trainer = with_mfu(pipeline, peak), with_mfu(trainer, peak)
  best = min(pipeline[m]["steady_step_s"] for m in MODES)  # (quick: stream's alone, so best_vs_tunix is omitted)
  return dict(
      devices=len(devices), params=MODEL.param_count(), peak_gflops=round(peak.flops / 1e9, 1),
      steady_step_s={k: round(v["steady_step_s"], 3) for k, v in pipeline.items()},
      best_steady_step_s=round(best, 3), best_vs_tunix=round(best / TUNIX_STEP_S, 3),
      train_tokens_per_s={k: round(v["train_tokens_per_s"], 1) for k, v in pipeline.items()},
      useful_train_mfu={k: round(v["useful_train_mfu"], 3) for k, v in pipeline.items()},
      padding_frac={k: round(v["padding_frac"], 3) for k, v in pipeline.items()},
      breakdown_s={k: {p: round(v[p], 3) for p in ("generation_s", "train_s", "weight_sync_s", "trainer_idle_frac",
                                                   "train_calls")} for k, v in pipeline.items()},
      packed_vs_unpacked_step={m: round(pipeline[m]["steady_step_s"] / pipeline[f"{m}_unpacked"]["steady_step_s"], 3)
                               for m in MODES if f"{m}_unpacked" in pipeline},
      long_tail=long_tail_figures(trainer["long_tail"], trainer.get("long_tail_unpacked")),
      trainer_alone={k: {p: round(x, 4) for p, x in v.items()} for k, v in trainer.items()},
      steps=STEPS, skipped=SKIP, floor_s=round(84e9 / peak.flops, 3),
      **({"quick_omits": ["best_vs_tunix"]} if QUICK else {}))


if __name__ == "__main__":
  print(json.dumps(main()))
