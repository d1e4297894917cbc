"""Generation makespan of one long-tailed batch under three schedules, on the real engine.

The batch: long-tailed arithmetic prompts whose output length follows from the prompt (2 tokens per
character of the worked solution: 16-150 tokens, P50 36, P90 about 90). Lengths are forced
with max_new_tokens, so every schedule generates exactly the same tokens. The sampler mesh (8 host
devices) holds `INSTANCES` engine instances of 2 devices each.

  random_fifo   requests shuffled and dealt round-robin, admitted in arrival order, every instance at
                `SLOTS` slots (the baseline);
  skew_ranker   the output-length ranker (trained online beforehand on other prompts) predicts lengths;
                the pipeline's planner (`dispatch_requests`, skew-aware) splits the instances between
                the long tail and the rest and sizes their batches from this engine's measured per-token
                latency curve; longest-first admission inside each instance; as in the pipeline, an
                instance runs an engine compiled for its batch (rounded up to a power of two) with its
                busy slots capped at the batch;
  skew_oracle   the same with the true lengths.

Variants are interleaved, `REPEATS` times; the best time of each is kept. Prints one JSON object last:
makespan_s (by policy), skew_vs_random, skew_vs_oracle, ranker_recall_top20, ranker_cost_frac, and more.
A quick run (`benchmarks/sizing.py`): 128 requests on 4 host devices (one per instance), a 3-point latency
curve, a ranker trained for 4 rounds, and every plan run once untimed (outputs cut short) before one timed run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sizing import size  # noqa: E402

DEVICES = size(8, 4)  # host devices of the sampler mesh, split evenly between the instances
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from model_forward import CONFIG  # noqa: E402

from streamrl_jax.meshes import MeshShape, mesh_from_devices, split_mesh  # noqa: E402
from streamrl_jax.models import CharTokenizer, Transformer  # noqa: E402
from streamrl_jax.sampling import DecodeEngine, EngineConfig, StreamingSampler, measure_ptl_curve  # noqa: E402
from streamrl_jax.scheduling import (OnlineRanker, RankerConfig, SchedulingConfig, dispatch_requests,  # noqa: E402
                                     engine_slots, fifo_order, longest_first_admission, ranking_metrics)
from streamrl_jax.tasks import ArithmeticTask  # noqa: E402
from streamrl_jax.types import SamplingParams  # noqa: E402

INSTANCES, SLOTS, REQUESTS, REPEATS = 4, 16, size(256, 128), size(2, 1)
RANKER_ROUNDS, RANKER_ROUND_SIZE = size(8, 4), 128  # the ranker's online training before the batch
PTL_SIZES = size((1, 2, 4, 8, 16), (1, 4, 16))  # batches of the measured latency curve (the planner interpolates)
WARM_CAP = size(0, 20)  # if > 0: every plan runs once untimed first, outputs cut to this (its prefill shapes compile)
MAX_PROMPT, MAX_NEW, TOKENS_PER_CHAR = 32, 160, 2
TOKENIZER, TASK = CharTokenizer(), ArithmeticTask(max_digits=8)


def batch(n: int, seed: int):
  """(prompt tokens, output lengths) of n long-tailed arithmetic prompts."""
  rng = np.random.default_rng(seed)
  pairs = [TASK.sample(rng) for _ in range(n)]
  return ([TOKENIZER.encode(p) for p, _ in pairs],
          [min(MAX_NEW, TOKENS_PER_CHAR * (len(s) + 1)) for _, s in pairs])


class Engines:
  """One compiled engine per (instance mesh, slot count), built on first use and warmed up."""

  def __init__(self, graphdef, params, meshes):
    self.graphdef, self.params, self.meshes, self.cache = graphdef, params, meshes, {}

  def get(self, instance: int, slots: int) -> DecodeEngine:
    key = (instance, slots)
    if key not in self.cache:
      config = EngineConfig(num_slots=slots, max_prompt_length=MAX_PROMPT, max_new_tokens=MAX_NEW,
                            min_prefill_bucket=MAX_PROMPT)
      engine = DecodeEngine(self.graphdef, CONFIG, config, self.meshes[instance])
      warm = StreamingSampler([engine], self.params)
      warm.submit([5] * 8, SamplingParams(max_new_tokens=70))  # crosses the short attention window: both compile
      list(warm.stream())
      self.cache[key] = engine
    return self.cache[key]


def makespan(engines: Engines, dispatch, prompts, lengths, predicted, admission) -> float:
  """Seconds from submitting the batch to its last sample, each request on its planned instance, each
  instance on the engine the pipeline would pick for its batch (`engine_slots`) with busy slots capped."""
  plan = dispatch.plan
  sampler = StreamingSampler([engines.get(k, engine_slots(b, SLOTS)) for k, b in enumerate(plan.batch_sizes)],
                             engines.params, admission=admission)
  sampler.set_slot_limits(dispatch.slot_limits)
  start = time.perf_counter()
  for k, requests in enumerate(plan.assignment):  # in the plan's order: FIFO admits in it
    for r in requests:
      sampler.submit(prompts[r], SamplingParams(max_new_tokens=lengths[r]), group_id=r, instance=k,
                     predicted_length=float(predicted[r]))
  produced = sum(s.num_tokens for s in sampler.stream())
  elapsed = time.perf_counter() - start
  assert produced == sum(lengths), (produced, sum(lengths))
  return elapsed


def train_ranker(mesh) -> OnlineRanker:
  """The ranker as the pipeline grows it: rounds of observed (prompt, length) pairs, trained between."""
  ranker = OnlineRanker(RankerConfig(max_prompt_length=MAX_PROMPT), mesh)
  for round_ in range(RANKER_ROUNDS):
    prompts, lengths = batch(RANKER_ROUND_SIZE, seed=1000 + round_)
    ranker.observe(prompts, lengths)
    ranker.train()
  return ranker


def main() -> dict:
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  sampler_mesh = mesh_from_devices(jax.devices()[:DEVICES], MeshShape(DEVICES, 1, 1))
  engines = Engines(graphdef, params, split_mesh(sampler_mesh, [DEVICES // INSTANCES] * INSTANCES))
  curve = measure_ptl_curve(lambda slots: engines.get(0, slots), params, PTL_SIZES)  # instance 0's mesh
  ranker = train_ranker(sampler_mesh)
  prompts, lengths = batch(REQUESTS, seed=0)
  ranker.predict_lengths(prompts, default=MAX_NEW / 2)  # compile the scoring shape
  start = time.perf_counter()
  predicted = ranker.predict_lengths(prompts, default=MAX_NEW / 2)
  ranker_s = time.perf_counter() - start
  history, ids = ranker.history_lengths, list(range(INSTANCES))
  fifo = SchedulingConfig(policy="fifo", instances=INSTANCES)
  skew = SchedulingConfig(policy="skew_aware", instances=INSTANCES, ptl_curve=tuple(curve.items()))
  plans = {  # the pipeline's own planner: dispatch_requests, with the ranker's history for P90 / P50
      "random_fifo": (dispatch_requests(fifo, [0.0] * REQUESTS, history, ids, SLOTS), np.zeros(REQUESTS),
                      fifo_order),
      "skew_ranker": (dispatch_requests(skew, predicted, history, ids, SLOTS), predicted, longest_first_admission),
      "skew_oracle": (dispatch_requests(skew, lengths, history, ids, SLOTS), np.asarray(lengths, float),
                      longest_first_admission),
  }
  for dispatch, _, _ in plans.values():  # compile every engine a plan needs before timing
    for k, b in enumerate(dispatch.plan.batch_sizes):
      engines.get(k, engine_slots(b, SLOTS))
  if WARM_CAP:  # a quick run times each plan once: none of its prefill shapes may compile inside it
    for dispatch, guess, admission in plans.values():
      makespan(engines, dispatch, prompts, [min(n, WARM_CAP) for n in lengths], guess, admission)
  times = {name: [] for name in plans}
  for _ in range(REPEATS):
    for name, (dispatch, guess, admission) in plans.items():
      times[name].append(makespan(engines, dispatch, prompts, lengths, guess, admission))
  best = {name: min(t) for name, t in times.items()}
  metrics = ranking_metrics(predicted, lengths)
  return {
      "requests": REQUESTS, "instances": INSTANCES, "slots": SLOTS, "generated_tokens": int(sum(lengths)),
      "output_len_p50": float(np.median(lengths)), "output_len_p90": float(np.percentile(lengths, 90)),
      "output_len_max": int(max(lengths)),
      "ptl_ms_by_batch": {str(b): round(1e3 * s, 3) for b, s in curve.items()},
      "plans": {name: {"batch_sizes": list(d.plan.batch_sizes), "long_instances": d.plan.long_instances,
                       "requests": [len(a) for a in d.plan.assignment]} for name, (d, _, _) in plans.items()},
      "makespan_runs_s": {name: [round(x, 3) for x in t] for name, t in times.items()},
      "makespan_s": {name: round(x, 3) for name, x in best.items()},
      "skew_vs_random": round(best["skew_ranker"] / best["random_fifo"], 3),
      "skew_vs_oracle": round(best["skew_ranker"] / best["skew_oracle"], 3),
      "oracle_vs_random": round(best["skew_oracle"] / best["random_fifo"], 3),
      "ranker_recall_top20": metrics["recall_top20"], "ranker_recall_top10": metrics["recall_top10"],
      "ranker_recall_top5": metrics["recall_top5"], "ranker_spearman": round(metrics["spearman"], 4),
      "ranker_inference_s": round(ranker_s, 5),
      "ranker_cost_frac": round(ranker_s / best["skew_ranker"], 5),
  }


if __name__ == "__main__":
  print(json.dumps(main()))
