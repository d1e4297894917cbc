"""The models people bring, at their size on this CPU: a Qwen3-0.6B-shaped model (28 layers, hidden 1,024, 16 query
and 8 KV heads of 128, MLP 3,072, vocabulary 151,936, tied embeddings; random weights, float32) trained by
`streamrl train` for two async RL steps (2 prompts x 4 samples x 16 new tokens, the arithmetic task; no warm-up, one
held-out prompt), as a user runs it: one process, its CPU devices its own.

Prints `qwen3_0p6b_step_s` (the second step's wall seconds, `step_s`: the first compiles), `qwen3_0p6b_first_step_s`,
`qwen3_0p6b_peak_rss_mb` (the run's processes summed: process_memory.py) and `families_supported` (the architectures
config.json may name); beside them the same run with the sampler's weights in bfloat16 (`SamplerConfig.precision`:
an async run holds up to three sampler versions, the one decoding, the newest landed and one landing),
`qwen3_0p6b_bf16_sampler_*`. A quick run (STREAMRL_BENCH_QUICK=1) trains the same shape cut to 4 layers of hidden 256.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, by module name
from sizing import QUICK, size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QWEN3_0P6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                  num_kv_heads=8, head_dim=128, architecture="qwen3", qk_norm=True, tie_embeddings=True,
                  rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)
SHAPE = size(QWEN3_0P6B, {**QWEN3_0P6B, "num_layers": 4, "hidden_size": 256, "intermediate_size": 768,
                          "num_heads": 4, "num_kv_heads": 2, "head_dim": 64})
WORK = ("PipelineConfig.mode='async'", "PipelineConfig.steps=2", "PipelineConfig.prompts_per_step=2",
        "PipelineConfig.group_size=4", "PipelineConfig.max_new_tokens=16", "EngineConfig.num_slots=8",
        "EngineConfig.max_prompt_length=32", "EngineConfig.min_prefill_bucket=32", "JobConfig.warmup_steps=0",
        "JobConfig.eval_prompts=1", "TaskConfig.name='arithmetic'", "JobConfig.report_to=()")


def byte_tokenizer(vocab_size: int):
  """A byte-level BPE tokenizer of exactly `vocab_size` ids: three specials, the 256 bytes, then fillers (so every
  id a random model samples decodes)."""
  import tokenizers
  from tokenizers import AddedToken, decoders, models, pre_tokenizers

  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  names = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
  names += [f"<|filler_{i}|>" for i in range(vocab_size - len(names))]
  tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(names)}, [], fuse_unk=False))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  return tok


def write_model(directory: Path, fields: dict) -> int:
  """A random model of `fields` as a Hugging Face directory (weights, config, tokenizer); returns its parameters."""
  from flax import nnx

  from streamrl_jax.models import ModelConfig, Transformer, save_hf

  config = ModelConfig(**fields, eos_token_id=0, bos_token_id=None)
  model = Transformer(config, rngs=nnx.Rngs(0))
  save_hf(model, directory)
  byte_tokenizer(config.vocab_size).save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="PreTrainedTokenizerFast", eos_token="<|endoftext|>", pad_token="<|endoftext|>")))
  count = config.param_count()
  del model
  gc.collect()
  return count


def train(model_dir: Path, workdir: Path, extra: tuple = ()) -> dict:
  """`streamrl train` of the work on `model_dir` (with `extra` settings): its rows and the run's memory."""
  from process_memory import run_measured

  sets = [a for s in (*WORK, *extra, f"JobConfig.model={str(model_dir)!r}") for a in ("--set", s)]
  done = run_measured([sys.executable, "-m", "streamrl_jax.cli", "train", "--workdir", str(workdir), *sets], cwd=ROOT,
                      env=dict(os.environ, XLA_FLAGS=""))
  if done["returncode"]:
    raise RuntimeError(f"streamrl train: exit {done['returncode']}\n{done['output'][-3000:]}")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return dict(rows=rows, peak_rss_mb=done["peak_rss_mb"], peak_processes=done["peak_processes"],
              seconds=done["seconds"])


def main() -> None:
  from streamrl_jax.models.families import ARCHITECTURES

  with tempfile.TemporaryDirectory(prefix="families_") as tmp:  # weights and checkpoints: gigabytes
    model_dir = Path(tmp) / "qwen3-0.6b-shaped"
    params = write_model(model_dir, SHAPE)
    run = train(model_dir, Path(tmp) / "run")
    bf16 = train(model_dir, Path(tmp) / "bf16", ("SamplerConfig.precision='bfloat16'",))
  rows = run["rows"]
  out = {"workload": f"Qwen3-0.6B-shaped ({SHAPE['num_layers']} layers, hidden {SHAPE['hidden_size']}), random "
                     f"weights, float32; {WORK}", "quick": QUICK, "parameters": params,
         "qwen3_0p6b_first_step_s": round(rows[0]["step_s"], 2),
         "qwen3_0p6b_step_s": round(rows[-1]["step_s"], 2), "qwen3_0p6b_peak_rss_mb": run["peak_rss_mb"],
         "qwen3_0p6b_peak_processes": run["peak_processes"], "qwen3_0p6b_run_s": run["seconds"],
         "qwen3_0p6b_trainer_s": {k.split("/", 1)[1]: round(v, 2) for k, v in rows[-1].items()
                                  if k.startswith("trainer_s/")},
         "qwen3_0p6b_bf16_sampler_step_s": round(bf16["rows"][-1]["step_s"], 2),
         "qwen3_0p6b_bf16_sampler_peak_rss_mb": bf16["peak_rss_mb"],
         "families_supported": len(ARCHITECTURES), "families": sorted(ARCHITECTURES)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
