"""The paged engine against the contiguous one at equal KV memory, on the benchmark model (~10M parameters).

1. Long-tailed lengths (the sampler benchmark's workload: 128 requests, 85% of outputs 12-36 tokens, 15%
   200-256): the contiguous engine holds 16 slots of 288 tokens; the paged engine the same 4,608 tokens as
   288 pages of 16, over up to 64 rows. `paged_vs_contiguous` is the tokens/s ratio; rows in flight are the
   mean busy rows per decode call.
2. GRPO groups (G = 8, prompts of 256 tokens, outputs of 16-64): the same budget (16 slots of 320 tokens, 320
   pages). `shared_vs_unshared` is the samples/s ratio of the paged engine with a group's prompt prefilled
   once and its pages shared against the same engine prefilling every request (`share_prompts=False`);
   `prefill_tokens_per_group` is what the shared arm prefilled per group.
3. `decode_overhead`: seconds of a decode call at equal rows (16) and lengths, paged over contiguous, minus 1.

`--shape smollm2` runs parts 1 and 3 with randomly initialised weights of SmolLM2-135M's shapes (30 layers,
hidden 576, vocabulary 49,152) instead of the benchmark model: the decision between the layouts on a real
model's arithmetic, on whatever backend runs it.

Each arm runs the workload once untimed (every shape compiles), then twice interleaved; the best counts. Prints one JSON object as its last line.
A quick run (`benchmarks/sizing.py`) times each arm once, on 48 long-tailed requests, 4 groups of outputs up to 32
tokens and 12 decode calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from model_forward import CONFIG  # noqa: E402
from precision import SMOLLM2_SHAPE  # noqa: E402
from sampler import MAX_NEW, MAX_PROMPT, NUM_REQUESTS, workload  # noqa: E402
from sizing import size  # noqa: E402

from streamrl_jax.meshes import single_device_mesh  # noqa: E402
from streamrl_jax.models import Transformer  # noqa: E402
from streamrl_jax.sampling import EngineConfig, StreamingSampler, kv_tokens, make_engine  # noqa: E402
from streamrl_jax.types import SamplingParams  # noqa: E402

SLOTS, ROWS, PAGE = 16, 64, 16
GROUP, GROUPS, GROUP_PROMPT, GROUP_NEW = 8, 12, 256, 64
# This run's sizes (`benchmarks/sizing.py`): long-tailed requests, GRPO groups and their longest output, timed
# runs of each arm (after the untimed one that compiles), decode calls timed for the overhead.
RUN_REQUESTS, RUN_GROUPS, RUN_GROUP_NEW = size(NUM_REQUESTS, 48), size(GROUPS, 4), size(GROUP_NEW, 32)
RUN_REPEATS, RUN_DECODE_CALLS = size(2, 1), size(30, 12)


def run(engine, params, requests) -> dict:
  """Generates every (prompt, length, group id) request; seconds, tokens, samples, mean rows in flight."""
  sampler = StreamingSampler([engine], params)
  for prompt, length, group in requests:
    sampler.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=length), group_id=group)
  start, tokens, samples, rows = time.perf_counter(), 0, 0, []
  while sampler.has_work():
    finished = sampler.step()
    rows.append(sampler.num_in_flight + len(finished))
    tokens += sum(s.num_tokens for s in finished)
    samples += len(finished)
  seconds = time.perf_counter() - start
  assert samples == len(requests) and tokens == sum(n for _, n, _ in requests), (samples, tokens)
  return dict(seconds=seconds, tokens=tokens, samples=samples, rows_in_flight=float(np.mean(rows)),
              preempted=sampler.counters["preempted"])


def long_tailed(graphdef, params, mesh, config=CONFIG, num_requests: int = NUM_REQUESTS, repeats: int = 2) -> dict:
  prompts, lengths = workload(requests=num_requests)
  requests = [(p, n, i) for i, (p, n) in enumerate(zip(prompts, lengths))]
  common = dict(max_prompt_length=MAX_PROMPT, max_new_tokens=MAX_NEW, min_prefill_bucket=32, steps_per_sync=4)
  engines = {"contiguous": make_engine(graphdef, config, EngineConfig(num_slots=SLOTS, **common), mesh),
             "paged": make_engine(graphdef, config, EngineConfig(num_slots=ROWS, kv_layout="paged", page_size=PAGE,
                                                                 kv_pages=SLOTS * (MAX_PROMPT + MAX_NEW) // PAGE,
                                                                 **common), mesh)}
  assert kv_tokens(engines["paged"]) == kv_tokens(engines["contiguous"])
  return _arms(engines, params, requests, repeats)


def grouped(graphdef, params, mesh, config=CONFIG, groups: int = GROUPS, new_tokens: int = GROUP_NEW,
            repeats: int = 2) -> dict:
  """GRPO groups of G random prompts of GROUP_PROMPT tokens, outputs of 16 to `new_tokens`, shared and unshared."""
  rng = np.random.default_rng(1)
  requests = []
  for g in range(groups):
    prompt = rng.integers(3, config.vocab_size, GROUP_PROMPT).tolist()
    requests += [(prompt, int(n), g) for n in rng.integers(16, new_tokens + 1, GROUP)]
  common = dict(num_slots=ROWS, max_prompt_length=GROUP_PROMPT, max_new_tokens=new_tokens,
                min_prefill_bucket=GROUP_PROMPT, steps_per_sync=4, kv_layout="paged", page_size=PAGE,
                kv_pages=SLOTS * (GROUP_PROMPT + new_tokens) // PAGE)
  engines = {"shared": make_engine(graphdef, config, EngineConfig(**common), mesh),
             "unshared": make_engine(graphdef, config, EngineConfig(**common, share_prompts=False), mesh)}
  out = _arms(engines, params, requests, repeats)
  out["prefill_tokens_per_group"] = out.pop("shared_prefill_tokens") / (repeats * groups)  # over the timed runs
  out.pop("unshared_prefill_tokens")
  out["group_prompt_tokens"] = GROUP_PROMPT
  out["shared_vs_unshared"] = round(out["shared_samples_per_s"] / out["unshared_samples_per_s"], 3)
  return out


def _arms(engines: dict, params, requests, repeats: int = 2) -> dict:
  for engine in engines.values():
    run(engine, params, requests)  # compiles every shape the timed runs meet
    if hasattr(engine, "counters"):  # the paged engine's
      engine.counters.reset()
  results = {name: [] for name in engines}
  for _ in range(repeats):
    for name, engine in engines.items():
      results[name].append(run(engine, params, requests))
  out = {}
  for name, runs in results.items():
    best = min(runs, key=lambda r: r["seconds"])
    out.update({f"{name}_tokens_per_s": round(best["tokens"] / best["seconds"], 1),
                f"{name}_samples_per_s": round(best["samples"] / best["seconds"], 2),
                f"{name}_rows_in_flight": round(best["rows_in_flight"], 1), f"{name}_preempted": best["preempted"],
                f"{name}_prefill_tokens": getattr(engines[name], "counters", {}).get("prefill_tokens", 0),
                f"{name}_prefix_cache_hits": getattr(engines[name], "counters", {}).get("prefix_cache_hits", 0),
                f"{name}_resume_prefill_tokens": getattr(engines[name], "counters", {}).get("resume_prefill_tokens", 0)})
  return out


def decode_overhead(graphdef, params, mesh, config=CONFIG, calls: int = 30) -> dict:
  """Seconds per decode call (4 steps) with 16 rows of 40-token prompts, contiguous and paged at one window."""
  common = dict(num_slots=SLOTS, max_prompt_length=64, max_new_tokens=256, min_prefill_bucket=64, steps_per_sync=4,
                prefill_batch=16)
  engines = {"contiguous": make_engine(graphdef, config, EngineConfig(**common), mesh),
             "paged": make_engine(graphdef, config, EngineConfig(**common, kv_layout="paged", page_size=PAGE), mesh)}
  prompts = [list(range(3 + i, 43 + i)) for i in range(SLOTS)]
  knobs = [SamplingParams(temperature=1.0, max_new_tokens=256)] * SLOTS
  keys = np.stack([np.asarray([0, i], np.uint32) for i in range(SLOTS)])
  states = {}
  for name, engine in engines.items():
    placed = engine.place_params(params)
    state = engine.insert(engine.prefill(placed, prompts, samplings=knobs, rngs=keys), engine.init_decode_state(),
                          list(range(SLOTS)))
    states[name] = (placed, state)
  seconds = {name: [] for name in engines}
  window = engines["paged"].config.window_for(40 + 4 * (calls + 2))
  for _ in range(calls):
    for name, engine in engines.items():
      placed, state = states[name]
      state, _ = engine.make_room(state, {s: 1 for s in range(SLOTS)})
      begin = time.perf_counter()
      state, out = engine.generate(placed, state, window)
      jax.block_until_ready(out.tokens)
      seconds[name].append(time.perf_counter() - begin)
      states[name] = (placed, state)
  median = {name: float(np.median(v[2:])) for name, v in seconds.items()}  # the first calls compile
  return dict(decode_call_s_contiguous=round(median["contiguous"], 5), decode_call_s_paged=round(median["paged"], 5),
              decode_overhead=round(median["paged"] / median["contiguous"] - 1, 3), decode_window=window)


def main(shape: str = "benchmark") -> dict:
  config = SMOLLM2_SHAPE if shape == "smollm2" else CONFIG
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  mesh = single_device_mesh(jax.devices()[0])
  out = dict(shape=shape, backend=jax.default_backend(), kv_budget_tokens=SLOTS * (MAX_PROMPT + MAX_NEW),
             page_size=PAGE, paged_rows=ROWS)
  out.update(long_tailed(graphdef, params, mesh, config, num_requests=RUN_REQUESTS, repeats=RUN_REPEATS))
  out["paged_vs_contiguous"] = round(out["paged_tokens_per_s"] / out["contiguous_tokens_per_s"], 3)
  if shape != "smollm2":
    out.update(grouped(graphdef, params, mesh, groups=RUN_GROUPS, new_tokens=RUN_GROUP_NEW, repeats=RUN_REPEATS))
  out.update(decode_overhead(graphdef, params, mesh, config, calls=RUN_DECODE_CALLS))
  return out


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", choices=("benchmark", "smollm2"), default="benchmark",
                      help="the model's shapes: the ~10M benchmark model or SmolLM2-135M's (random weights)")
  print(json.dumps(main(parser.parse_args().shape)))
