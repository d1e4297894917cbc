"""Continuous batching against static batching and Hugging Face `generate` on a long-tailed workload.

The same ~10M-parameter weights and the same requests go through: this engine (continuous
batching, samples leave as they finish), static batching on the same engine kernels (a batch of
`num_slots` requests is admitted only when the previous batch has fully finished), and transformers
`generate` on torch CPU in static batches (every core's threads, one untimed batch first). Output lengths are fixed
per request (most short, a tail about 10x longer) and only tokens up to each request's own end are counted. Every
arm is timed REPEATS times, interleaved, its best kept; the engine and static batching each on both sync settings
(`steps_per_sync` 1 and 4), their best kept, so neither is credited with the other's setting. The engine's decode
calls take the steps the sampler's policy picks (`adaptive_steps`); one more arm decodes 4 steps every call
(`fixed_steps`): `adaptive_vs_fixed_steps`. The faster engine arm runs once more with every program waited for and
timed on the device (`launch.device_clock`): `sampler_device_busy_frac` is those device seconds over that pass's
wall time, a lower bound of the device's share of the sampler's time (the host's admission, read-back and
bookkeeping the rest; the clock keeps them from overlapping the device).

Prints one JSON object as its last line: engine_tokens_per_s, static_tokens_per_s, hf_tokens_per_s,
engine_vs_static, engine_vs_hf, adaptive_vs_fixed_steps, sampler_device_busy_frac, decode_mfu, kv_bytes_per_slot,
ptl_ms_by_batch, and more. A quick run
(`benchmarks/sizing.py`): 64 requests for every arm (HF included), each engine arm timed once after an untimed
pass, and the latency curve at 1 and 32 slots.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from model_forward import CONFIG  # noqa: E402
from peak import Peak  # noqa: E402
from sizing import size  # noqa: E402

from streamrl_jax import launch  # noqa: E402
from streamrl_jax.meshes import MeshShape, mesh_from_devices  # noqa: E402
from streamrl_jax.models import Transformer, save_hf  # noqa: E402
from streamrl_jax.sampling import DecodeEngine, EngineConfig, StreamingSampler, measure_ptl_curve  # noqa: E402
from streamrl_jax.scheduling import adaptive_steps, fixed_steps  # noqa: E402
from streamrl_jax.types import SamplingParams  # noqa: E402

SLOTS, NUM_REQUESTS, MAX_PROMPT, MAX_NEW = 32, 128, 32, 256
TAIL_FRACTION = 0.15
REQUESTS = size(NUM_REQUESTS, 64)  # this run's workload, every arm (HF included) on the same requests
REPEATS = size(2, 1)  # interleaved timed runs of each engine arm; the best kept
PTL_BATCHES, PTL_STEPS = size((1, 2, 4, 8, 16, 32), (1, 32)), size(24, 8)


def workload(seed: int = 0, requests: int = NUM_REQUESTS):
  """(prompts, output lengths): prompts of 8-32 tokens; 85% of outputs 12-36 tokens, 15% 200-256."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, CONFIG.vocab_size, rng.integers(8, MAX_PROMPT + 1)).tolist() for _ in range(requests)]
  tail = rng.random(requests) < TAIL_FRACTION
  lengths = np.where(tail, rng.integers(200, MAX_NEW + 1, requests), rng.integers(12, 37, requests))
  return prompts, lengths.tolist()


def run_engine(engine, params, prompts, lengths, *, static: bool, steps=adaptive_steps) -> float:
  """Seconds to generate every request; static admits a new batch only when the last one is done; `steps`: the
  sampler's decode-steps policy."""
  sampler = StreamingSampler([engine], params, steps=steps)
  start = time.perf_counter()
  produced = 0
  batches = [range(i, min(i + SLOTS, len(prompts))) for i in range(0, len(prompts), SLOTS)] if static else [range(len(prompts))]
  for batch in batches:
    for i in batch:
      sampler.submit(prompts[i], SamplingParams(temperature=1.0, max_new_tokens=lengths[i]))
    produced += sum(s.num_tokens for s in sampler.stream())
  elapsed = time.perf_counter() - start
  assert produced == sum(lengths), (produced, sum(lengths))
  return elapsed


def hf_model(directory):
  import os

  import torch
  import transformers

  torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core this process may use, as jax's
  model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
  model.generation_config.eos_token_id = None
  return model


def run_hf(model, prompts, lengths) -> float:
  import torch

  start = time.perf_counter()
  for i in range(0, len(prompts), SLOTS):
    batch = prompts[i:i + SLOTS]
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
      model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=max(lengths[i:i + SLOTS]),
                     pad_token_id=0)
  return time.perf_counter() - start


def ptl_curve(graphdef, params, mesh, batches=PTL_BATCHES) -> dict[str, float]:
  """Per-token decode latency (ms per step) with every one of `batch` slots generating."""
  def engine_for(slots):
    return DecodeEngine(graphdef, CONFIG, EngineConfig(num_slots=slots, max_prompt_length=MAX_PROMPT,
                                                       max_new_tokens=MAX_NEW, min_prefill_bucket=32), mesh)
  curve = measure_ptl_curve(engine_for, params, batches, steps=PTL_STEPS, prompt=[5] * 16)
  return {str(b): round(1e3 * s, 3) for b, s in curve.items()}


def device_busy(engines, params, prompts, lengths, best) -> dict:
  """The faster engine arm's workload once more with every program waited for and timed on the device
  (`launch.device_clock`). The clock runs host and device one after the other, so its device seconds over that
  pass's own wall time is a lower bound of how busy the device is in the arm's normal run (where the host's work
  overlaps the device's): `sampler_device_busy_frac`. Over the arm's best normal wall time (another run: noisy,
  may pass 1): `sampler_device_over_wall`."""
  sync = 1 if best["engine_sync1"] <= best["engine_sync4"] else 4
  with launch.device_clock() as clock:
    clocked = run_engine(engines[sync], params, prompts, lengths, static=False)
  device_s = clock.total_device_s
  return {"sampler_device_busy_frac": round(device_s / clocked, 3),
          "sampler_device_over_wall": round(device_s / best[f"engine_sync{sync}"], 3),
          "sampler_dispatch_frac": round(sum(clock.dispatch_s.values()) / clocked, 3), "busy_arm_sync": sync,
          "busy_arm_launches": sum(clock.launches.values())}


def main() -> dict:
  prompts, lengths = workload(requests=REQUESTS)
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  engines = {k: DecodeEngine(graphdef, CONFIG, EngineConfig(num_slots=SLOTS, max_prompt_length=MAX_PROMPT,
                                                            max_new_tokens=MAX_NEW, min_prefill_bucket=32,
                                                            steps_per_sync=k), mesh) for k in (1, 4)}
  # compile; a quick run times each arm once, so it warms up on the workload itself (outputs cut to 72 tokens:
  # still past the short attention window, and admitting in every row bucket the timed run meets)
  warm = size((prompts[:SLOTS], [4] * SLOTS), (prompts, [min(n, 72) for n in lengths]))
  for engine in engines.values():
    run_engine(engine, params, *warm, static=False)
  peak = Peak()
  peak.measure()
  with tempfile.TemporaryDirectory() as tmp:
    save_hf(model, tmp)
    reference = hf_model(tmp)
  run_hf(reference, prompts[:SLOTS], [4] * SLOTS)  # warm-up, as the engine's compile pass
  times = {"engine_sync1": [], "engine_sync4": [], "engine_sync4_fixed": [], "static_sync1": [], "static_sync4": [],
           "hf": []}
  for _ in range(REPEATS):  # interleaved repeats; best kept
    for sync in (1, 4):
      times[f"engine_sync{sync}"].append(run_engine(engines[sync], params, prompts, lengths, static=False))
      times[f"static_sync{sync}"].append(run_engine(engines[sync], params, prompts, lengths, static=True))
    times["engine_sync4_fixed"].append(run_engine(engines[4], params, prompts, lengths, static=False,
                                                  steps=fixed_steps))
    times["hf"].append(run_hf(reference, prompts, lengths))
  peak.measure()
  tokens = sum(lengths)
  best = {k: min(v) for k, v in times.items()}
  engine_s, static_s = (min(best[f"{arm}_sync1"], best[f"{arm}_sync4"]) for arm in ("engine", "static"))
  busy = device_busy(engines, params, prompts, lengths, best)
  hf_s = best["hf"]
  context = MAX_PROMPT / 2 + float(np.mean(lengths)) / 2
  return {
      "requests": REQUESTS, "generated_tokens": tokens, "slots": SLOTS,
      "output_len_p50": float(np.median(lengths)), "output_len_max": int(max(lengths)),
      "engine_tokens_per_s": round(tokens / engine_s, 1),
      "engine_sync1_tokens_per_s": round(tokens / best["engine_sync1"], 1),
      "engine_sync4_tokens_per_s": round(tokens / best["engine_sync4"], 1),
      "static_tokens_per_s": round(tokens / static_s, 1),
      "hf_tokens_per_s": round(tokens / hf_s, 1),
      "engine_vs_static": round(static_s / engine_s, 3),
      "engine_vs_hf": round(hf_s / engine_s, 3),
      "adaptive_vs_fixed_steps": round(best["engine_sync4_fixed"] / best["engine_sync4"], 3),
      **busy,
      "peak_gflops": round(peak.flops / 1e9, 2),
      "decode_mfu": round(peak.mfu(CONFIG.flops_per_token(context) * tokens / engine_s), 4),
      "kv_bytes_per_slot": engines[1].memory["kv_bytes_per_slot"],
      "ptl_ms_by_batch": ptl_curve(graphdef, params, mesh),
  }


if __name__ == "__main__":
  print(json.dumps(main()))
