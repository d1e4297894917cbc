"""Multi-turn rollouts with a calculator tool: what the tool is worth after training, and what slow tools cost.

- `tool_gain`: two `train_job` runs on 3-digit multiplication with the demo decoder (hidden 64, 2 layers), each
  with a supervised warm-up on its own worked solutions and then STEPS GRPO steps in `stream` mode: one with the
  calculator (`EnvConfig.environment='calculator'`: the model writes `<A*B>`, the environment appends the
  product with loss mask 0, the model writes `;=` and the answer), one without (the answer alone). Held-out
  greedy accuracy after training, with the tool minus without.
- `slow_tool_throughput_ratio`: the tool run's trained model samples PROMPTS held-out prompts (8 a group, 32
  slots: a sampler with four steps of work queued, as in async runs) with instant tools and with 50 ms added to
  every tool call, interleaved REPEATS times: samples/s with slow tools over instant ones. A row waiting on a
  tool pauses alone while the others decode, and is parked off its slot for a queued request after one step.
  Also reported: one step's 128 samples alone (`slow_tool_ratio_one_step`: the last rows' waits have nothing to
  overlap with) and 8 tool threads instead of 64 (`slow_tool_ratio_8_threads`: calls queue for a thread).
- The same on the paged engine (`EngineConfig.kv_layout='paged'`, pages of 16 tokens, the contiguous engine's
  KV memory): `paged_tool_gain` trains the tool run on it (minus the same run without the tool), and
  `paged_slow_tool_throughput_ratio` is its slow over instant samples/s, interleaved with the arms above
  (`paged_vs_contiguous_instant`: its instant samples/s over the contiguous engine's).

Prints one JSON object as its last line.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402

STEPS, WARMUP, DIGITS, REPEATS, PROMPTS = size(8, 2), size(300, 30), 3, size(5, 1), 512
EVAL = size(128, 64)  # held-out prompts of each run's greedy accuracy
PAGED_RUN = size(True, False)  # the tool run trained on the paged engine (quick: only the paged engine's arms)
PRECOMPILE = size(True, False)  # every extend/park shape compiled first (quick: the untimed pass compiles them)
THREADS_ARM = size(True, False)  # the slow_8_threads arm (quick: left out; no goal names it)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # a sampler and a trainer device


def configs():
  from streamrl_jax.pipeline.config import PipelineConfig
  from streamrl_jax.envs import EnvConfig
  from streamrl_jax.job.config import JobConfig
  from streamrl_jax.tasks.config import TaskConfig
  from streamrl_jax.sampling.engine import EngineConfig
  from streamrl_jax.sampling.config import SamplerConfig
  engine = EngineConfig(num_slots=32, max_prompt_length=16, max_new_tokens=32)
  base = dict(mode="stream", steps=STEPS, prompts_per_step=16, group_size=8, max_new_tokens=32)
  tool = (PipelineConfig(**base, sampler=SamplerConfig(engine=engine, env=EnvConfig(environment="calculator"))),
          JobConfig(task=TaskConfig(name="multiply", multiply_digits=DIGITS), warmup_steps=WARMUP, eval_prompts=EVAL))
  plain = (PipelineConfig(**base, sampler=SamplerConfig(engine=engine)),
           JobConfig(task=TaskConfig(name="multiply_no_tool", multiply_digits=DIGITS), warmup_steps=WARMUP,
                     eval_prompts=EVAL))
  paged_engine = dataclasses.replace(engine, kv_layout="paged", page_size=16)
  paged = (dataclasses.replace(tool[0], sampler=dataclasses.replace(tool[0].sampler, engine=paged_engine)), tool[1])
  return tool, plain, paged


def train(config, job, workdir: Path) -> dict:
  from streamrl_jax.pipeline.train_job import train_job
  start = time.perf_counter()
  summary = train_job(config, job, workdir)
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return dict(accuracy_before=round(summary["accuracy_before"], 4), accuracy_after=round(summary["accuracy_after"], 4),
              reward_by_step=[round(m["reward_mean"], 3) for m in metrics], wall_s=round(time.perf_counter() - start,
                                                                                         1))


def sampling_rate(engine, params, config, delay_s: float, seed: int, prompts: int = PROMPTS) -> tuple[float, dict]:
  """Samples/s of PROMPTS prompts on `engine` (compiled already by an earlier call) with tools of `delay_s`."""
  from streamrl_jax.envs import ToolRunner, make_environment
  from streamrl_jax.models import CharTokenizer
  from streamrl_jax.sampling import StreamingSampler
  from streamrl_jax.tasks import MultiplyTask
  from streamrl_jax.types import SamplingParams
  tokenizer = CharTokenizer()
  tools = ToolRunner(make_environment("calculator", max_turns=config.sampler.env.max_turns), tokenizer, delay_s=delay_s,
                     threads=config.sampler.env.tool_threads)
  sampler = StreamingSampler([engine], params, tools=tools, seed=seed)
  rng = np.random.default_rng(seed)
  knobs = SamplingParams(temperature=1.0, max_new_tokens=config.max_new_tokens, stop_token_ids=tokenizer.stop_ids,
                         num_samples=8)
  for g in range(prompts // 8):
    sampler.submit(tokenizer.encode(MultiplyTask(DIGITS).sample(rng)[0]), knobs, group_id=g)
  start = time.perf_counter()
  samples = list(sampler.stream())
  seconds = time.perf_counter() - start
  tools.close()
  return len(samples) / seconds, dict(sampler.counters, tool_s=round(tools.counters["tool_s"], 2))


def precompile(engine, params) -> None:
  """Compiles `extend` for every row bucket and length bucket, and `park`/`unpark` for every row bucket."""
  state, parking = engine.init_decode_state(), engine.init_parking()
  for rows in engine.config.row_buckets:
    for length in engine.config.extend_buckets:
      state, _ = engine.extend(params, state, list(range(rows)), [[1] * length] * rows)
    state, parking = engine.park(state, parking, list(range(rows)), list(range(rows)))
    state, parking = engine.unpark(state, parking, list(range(rows)), list(range(rows)))


def main() -> dict:
  from streamrl_jax.models import load_hf
  if QUICK:  # shapes the runs and the engines share compile once (the untimed pass compiles the rest)
    import jax
    cache = tempfile.mkdtemp(prefix="multiturn-bench-cache-")
    atexit.register(shutil.rmtree, cache, True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  (tool_config, tool_job), (plain_config, plain_job), (paged_config, paged_job) = configs()
  out = {}
  with tempfile.TemporaryDirectory(prefix="streamrl-multiturn-") as tmp:
    runs = [("with_tool", tool_config, tool_job)] + ([] if QUICK else [("without_tool", plain_config, plain_job)])
    for name, config, job in runs + ([("paged_with_tool", paged_config, paged_job)] if PAGED_RUN else []):
      out[name] = train(config, job, Path(tmp) / name)
      print(name, out[name], file=sys.stderr, flush=True)
    model = load_hf(Path(tmp) / "with_tool" / "final_model")
  if QUICK:  # the gain over the run without the tool is a full run's (the tool run is still trained: throughput's model)
    out["quick_omits"] = ["tool_gain"]
  else:
    out["tool_gain"] = round(out["with_tool"]["accuracy_after"] - out["without_tool"]["accuracy_after"], 4)
  if PAGED_RUN:
    out["paged_tool_gain"] = round(out["paged_with_tool"]["accuracy_after"] - out["without_tool"]["accuracy_after"], 4)
  out.update(throughput(model, tool_config, paged_config))
  out.update(tool_delay_s=0.05, steps=STEPS, warmup_steps=WARMUP, digits=DIGITS, eval_prompts=EVAL, repeats=REPEATS)
  return out


def throughput(model, tool_config, paged_config) -> dict:
  """Samples/s of the trained tool model with instant and slow tools, on both engines, interleaved."""
  from flax import nnx
  from streamrl_jax.meshes import single_device_mesh
  from streamrl_jax.sampling import make_engine
  graphdef, params = nnx.split(model)
  engines = {layout: make_engine(graphdef, model.config, config.sampler.engine, single_device_mesh())
             for layout, config in (("contiguous", tool_config), ("paged", paged_config))}
  few = dataclasses.replace(tool_config.sampler.env, tool_threads=8)
  few_threads = dataclasses.replace(tool_config, sampler=dataclasses.replace(tool_config.sampler, env=few))
  one_step = tool_config.prompts_per_step * tool_config.group_size
  arms = (("instant", "contiguous", 0.0, tool_config, PROMPTS), ("slow", "contiguous", 0.05, tool_config, PROMPTS),
          ("slow_8_threads", "contiguous", 0.05, few_threads, PROMPTS),
          ("instant_one_step", "contiguous", 0.0, tool_config, one_step),
          ("slow_one_step", "contiguous", 0.05, tool_config, one_step),
          ("paged_instant", "paged", 0.0, paged_config, PROMPTS), ("paged_slow", "paged", 0.05, paged_config, PROMPTS))
  arms = tuple(arm for arm in arms if THREADS_ARM or arm[0] != "slow_8_threads")
  rates, out = {arm[0]: [] for arm in arms}, {}
  for engine in engines.values() if PRECOMPILE else ():
    precompile(engine, params)
  for arm, layout, delay, config, prompts in arms:  # a pass untimed: every prefill and decode shape compiles
    sampling_rate(engines[layout], params, config, delay, seed=100, prompts=prompts)
  for rep in range(REPEATS):
    for arm, layout, delay, config, prompts in arms:
      rate, counters = sampling_rate(engines[layout], params, config, delay, seed=rep, prompts=prompts)
      rates[arm].append(round(rate, 2))
      out[f"{arm}_counters"] = counters
  print("rates", rates, file=sys.stderr, flush=True)
  ratio = lambda a, b: round(statistics.median(rates[a]) / statistics.median(rates[b]), 3)  # noqa: E731
  out.update(samples_per_s=rates, slow_tool_throughput_ratio=ratio("slow", "instant"),
             slow_tool_ratio_one_step=ratio("slow_one_step", "instant_one_step"),
             slow_tool_ratio_8_threads=ratio("slow_8_threads", "instant") if THREADS_ARM else None,
             paged_slow_tool_throughput_ratio=ratio("paged_slow", "paged_instant"),
             paged_vs_contiguous_instant=ratio("paged_instant", "instant"))
  return {k: v for k, v in out.items() if v is not None}  # a quick run's 8-thread ratio left out


if __name__ == "__main__":
  from streamrl_jax import logs

  logs.configure(role="multiturn")  # the run's progress lines on stderr; the JSON alone on stdout
  print(json.dumps(main()))
