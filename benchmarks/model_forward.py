"""Forward and training throughput of a ~10M-parameter decoder, as a fraction of measured matmul peak.

Prints one JSON object as its last line: params, forward_tokens_per_s, train_tokens_per_s,
peak_gflops (float32 matmul peak measured in this run, before and after: `peak.py`), forward_mfu, train_mfu.
Model FLOPs per token = 2 x matmul weights (LM head included, embedding lookup not) + attention;
a training step counts 3x the forward.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from streamrl_jax.models import ModelConfig, Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402
from sizing import size  # noqa: E402

CONFIG = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=8, num_heads=4,
                     num_kv_heads=2)
BATCH, LENGTH = 32, 128
REPEATS = size(5, 1)  # timed model calls (after one untimed), the best kept


def best_time(fn, *args, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def main() -> dict:
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(2), (BATCH, LENGTH), 0, CONFIG.vocab_size, jnp.int32)

  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))

  def loss_fn(p, t):
    logits = nnx.merge(graphdef, p)(t[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

  optimizer = optax.adamw(1e-4)
  opt_state = optimizer.init(params)

  @jax.jit
  def train_step(p, o, t):
    loss, grads = jax.value_and_grad(loss_fn)(p, t)
    updates, o = optimizer.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  peak = Peak()
  peak.measure()
  forward_s = best_time(forward, params, tokens, repeats=REPEATS)
  train_s = best_time(lambda p, t: train_step(p, opt_state, t), params, tokens, repeats=REPEATS)
  peak.measure()
  flops = CONFIG.flops_per_token(context_length=LENGTH / 2)  # causal: on average half the keys
  forward_tps = BATCH * LENGTH / forward_s
  train_tps = BATCH * (LENGTH - 1) / train_s
  return {
      "params": CONFIG.param_count(),
      "batch": BATCH, "length": LENGTH,
      "forward_tokens_per_s": round(forward_tps, 1),
      "train_tokens_per_s": round(train_tps, 1),
      "peak_gflops": round(peak.flops / 1e9, 2),
      "forward_mfu": round(peak.mfu(flops * forward_tps), 4),
      "train_mfu": round(peak.mfu(3 * flops * train_tps), 4),
      "backend": jax.default_backend(), "device_count": jax.device_count(),
  }


if __name__ == "__main__":
  print(json.dumps(main()))
