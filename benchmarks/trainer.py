"""Train-step throughput, and the cost of feeding a global batch as streamed micro-batches.

One global batch of 64 sequences x 128 tokens (32 prompt + up to 96 completion) on the ~10M-parameter
decoder, PPO with token-mean aggregation. Variants, interleaved, best of 3 kept:
  fused     the whole batch in one `accumulate`, then `apply`;
  fused_chunk16  the whole batch available at once but run in chunks of 16 rows (what the trainer does
            with a full batch: on this CPU the 64-row step is slower, its logits do not fit in cache);
  streamed  micro-batches of 8, 13, 11, 17, 15 sequences as they would arrive from the sampler, re-chunked
            by `MicroBatcher` into fixed chunks (rows carried between micro-batches), then `apply`;
  fused_bypass  `fused` with `ObjectiveConfig.old_logprobs='sampler'` (bypass: the sampler's log-probabilities as
            the old policy, no correction) against the default 'recompute' (`bypass_vs_recompute_step`: the
            saving of bypass; here the recomputed old policy is the step's own forward without gradient).
Prints one JSON object as its last line: train_tokens_per_s, train_mfu, dynamic_microbatch_overhead
(streamed time / fused time - 1), and more. A quick run (`benchmarks/sizing.py`) halves the batch (32 rows of
64 tokens, 16 prompt, arrivals of 4, 7, 5, 9, 7) and times each variant once.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from model_forward import CONFIG  # noqa: E402
from peak import Peak  # noqa: E402
from sizing import size  # noqa: E402

from streamrl_jax.meshes import MeshShape, mesh_from_devices  # noqa: E402
from streamrl_jax.models import Transformer  # noqa: E402
from streamrl_jax.training import MicroBatcher, ObjectiveConfig, OptimizerConfig, Trainer  # noqa: E402

ROWS, LENGTH, PROMPT = size(64, 32), size(128, 64), size(32, 16)
ARRIVALS = size((8, 13, 11, 17, 15), (4, 7, 5, 9, 7))
REPEATS = size(3, 2)  # interleaved timed steps of each variant (after one that compiles); the best kept


def global_batch(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  completion = rng.integers(16, LENGTH - PROMPT + 1, ROWS)
  pos = np.arange(LENGTH)[None]
  valid = pos < (PROMPT + completion)[:, None]
  return dict(tokens=rng.integers(0, CONFIG.vocab_size, (ROWS, LENGTH)).astype(np.int32), valid=valid,
              loss_mask=valid & (pos >= PROMPT), advantages=rng.normal(size=ROWS).astype(np.float32),
              logprobs=np.full((ROWS, LENGTH), -8.3, np.float32))


def run_fused(trainer, state, batch):
  state = trainer.accumulate(state, batch)
  state, metrics = trainer.apply(state)
  return state


def run_streamed(trainer, state, batch, chunk_rows, arrivals=ARRIVALS):
  batcher = MicroBatcher(trainer, chunk_rows=chunk_rows)
  start = 0
  for n in arrivals:
    state = batcher.add(state, {k: v[start:start + n] for k, v in batch.items()})
    start += n
  state, _ = batcher.finish(state)
  return state


def timed(fn, state, *args):
  start = time.perf_counter()
  state = fn(state, *args)
  jax.block_until_ready(state.params)
  return state, time.perf_counter() - start


def main() -> dict:
  assert sum(ARRIVALS) == ROWS
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=1e-5), ObjectiveConfig(), mesh)
  bypass = Trainer(graphdef, OptimizerConfig(learning_rate=1e-5), ObjectiveConfig(old_logprobs="sampler",
                                                                                  correction="none"), mesh)
  states = {"trainer": trainer.init_state(params), "fused_bypass": bypass.init_state(params)}
  batch = global_batch()
  variants = {"fused": lambda s: run_fused(trainer, s, batch),
              "fused_chunk16": lambda s: run_streamed(trainer, s, batch, 16, arrivals=(ROWS,)),
              "streamed_chunk8": lambda s: run_streamed(trainer, s, batch, 8),
              "streamed_chunk16": lambda s: run_streamed(trainer, s, batch, 16),
              "fused_bypass": lambda s: run_fused(bypass, s, batch)}
  own = lambda name: "fused_bypass" if name == "fused_bypass" else "trainer"  # noqa: E731  (a state each trainer)
  for name, fn in variants.items():  # compile every shape
    states[own(name)], _ = timed(fn, states[own(name)])
  times = {name: [] for name in variants}
  peak = Peak()
  peak.measure()
  for _ in range(REPEATS):
    for name, fn in variants.items():
      states[own(name)], seconds = timed(fn, states[own(name)])
      times[name].append(seconds)
  best = {name: min(v) for name, v in times.items()}
  peak.measure()
  tokens = ROWS * LENGTH
  tps = tokens / min(best["fused"], best["fused_chunk16"])  # the faster way to run a whole batch
  return {
      "params": CONFIG.param_count(), "global_batch_rows": ROWS, "length": LENGTH, "arrivals": list(ARRIVALS),
      "train_tokens_per_s": round(tps, 1),
      "train_mfu": round(peak.mfu(3 * CONFIG.flops_per_token(LENGTH / 2) * tps), 4),
      "peak_gflops": round(peak.flops / 1e9, 2),
      "step_s": {k: round(v, 4) for k, v in best.items()},
      "dynamic_microbatch_overhead": round(best["streamed_chunk8"] / best["fused"] - 1, 4),
      "dynamic_microbatch_overhead_chunk16": round(best["streamed_chunk16"] / best["fused"] - 1, 4),
      "streamed_vs_fused_chunk16_overhead": round(best["streamed_chunk16"] / best["fused_chunk16"] - 1, 4),
      "bypass_vs_recompute_step": round(best["fused_bypass"] / best["fused"], 4),
      "compiled_shapes": sorted(trainer.compiled_shapes),
  }


if __name__ == "__main__":
  print(json.dumps(main()))
