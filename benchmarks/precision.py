"""The sampler's weight precision (float32, bfloat16, int8 weight-only): bytes moved, transfer time, the
sampler-vs-trainer mismatch, sampler tokens/s, and what the mismatch does to RL on the CPU demo.

1. Transfer, on a model of SmolLM2-135M's shape (random weights: only sizes matter): a version published
   through the trainer's weight store, fetched over Arrow Flight on loopback, placed and finished on the
   sampler's device. int8 quantized on the trainer's side (a quarter of the bytes move) against on the
   sampler's side (float32 moves); bfloat16 and float32 beside. `int8_bytes_ratio` = int8 bytes / float32
   bytes; `<arm>_update_s` publish-to-usable seconds (best of 3, arms interleaved).
2. The demo model after its supervised warm-up: 256 held-out prompts sampled (temperature 1) with each
   precision's weights; the float32 trainer's log-probabilities of the sampled tokens against the sampler's:
   `mismatch_kl_<precision>` (mean per token of the k3 estimate of KL(mu || pi)), `mismatch_max_<precision>`;
   the sampler's `tokens_per_s_<precision>` (the same requests; a run that compiles, then the best of two
   runs, precisions interleaved).
3. RL: `streamrl train` on the demo in `stream` mode (on-policy GRPO, so that the only gap between sampler
   and trainer is the precision; STEPS steps, the warm-up shared) with a float32 sampler, an int8 sampler
   corrected (`ObjectiveConfig.correction='token_tis'`, formerly `ppo_tis`), and an int8 sampler uncorrected
   (`correction='none'`, formerly `ppo_recomputed`: the sampler's log-probabilities unused); held-out greedy
   accuracy on EVAL prompts after equal steps: `int8_accuracy_gap` (float32 minus corrected int8) and
   `int8_uncorrected_accuracy_gap`; each arm's `pipeline_mismatch_kl` (the trainer's metric,
   mean over steps).

Prints one JSON object as its last line.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax import gin_config
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import ModelConfig, Transformer, save_hf
from streamrl_jax.models.precision import PRECISIONS, SamplerPrecision, decode, encode, landing, wire_bytes
from streamrl_jax.job.warmup import supervised_warmup
from streamrl_jax.pytrees import flatten_with_names, unflatten_like
from streamrl_jax.sampling import StreamingSampler, make_engine
from streamrl_jax.streaming.flight_client import FlightConnection, fetch_weights
from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
from streamrl_jax.training.logprobs import token_logprobs
from streamrl_jax.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402

SMOLLM2_SHAPE = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                            num_kv_heads=3, tie_embeddings=True)
PROMPTS, STEPS, EVAL = size(256, 48), size(40, 2), size(512, 48)
VERSIONS = size(3, 2)  # weight versions each transfer arm publishes (the best counts)
WARMUP = size(None, 40)  # supervised steps of the demo's warm-up (None: the demo's own)
TIMED = size(2, 1)  # timed sampling runs per precision (the best counts)
ARMS = {"float32": ("float32", "token_tis"), "int8": ("int8", "token_tis"), "int8_uncorrected": ("int8", "none")}
RL_ARMS = size(tuple(ARMS), ())  # the RL arms run (quick: none; int8_accuracy_gap is a full run's)


def timed_update(store, connection, land, params, version: int) -> tuple[float, int]:
  """(seconds, bytes) of one version from publish to usable: published through the trainer's weight `store`,
  fetched over Flight, placed on the sampler's device and finished by its landing `land`."""
  expected = {k: tuple(v.shape) for k, v in flatten_with_names(land.template).items()}
  start = time.perf_counter()
  store.publish(params, version)
  store.wait_version(version, timeout=300)
  _, flat, nbytes = fetch_weights(connection, version, expected)
  placed = jax.device_put(unflatten_like(land.template, flat, "the weight stream"), land.shardings)
  jax.block_until_ready(land.finish(placed))
  return time.perf_counter() - start, nbytes


def transfer() -> dict:
  """Publish -> fetch over Flight -> place -> finish, per precision and side, on SmolLM2-135M's shapes."""
  _, params = nnx.split(Transformer(SMOLLM2_SHAPE, rngs=nnx.Rngs(0)))
  mesh = single_device_mesh(jax.devices()[0])
  arms = {"float32": SamplerPrecision(), "bfloat16": SamplerPrecision("bfloat16"),
          "int8_on_trainer": SamplerPrecision("int8", "trainer"), "int8_on_sampler": SamplerPrecision("int8",
                                                                                                      "sampler")}
  stores = {name: HostWeightStore(precision=p) for name, p in arms.items()}
  servers = {name: TrainerFlightServer("127.0.0.1", 0, controller=None, samples=None, weights=store,
                                       limits=ServerLimits(1))
             for name, store in stores.items()}
  seconds, nbytes = {name: [] for name in arms}, {}
  try:
    connections = {name: FlightConnection(server.address, timeout_s=120, retry_s=30) for name,
                   server in servers.items()}
    for version in range(VERSIONS):
      for name, precision in arms.items():
        seconds_taken, nbytes[name] = timed_update(stores[name], connections[name], landing(params, precision, mesh),
                                                   params, version)
        seconds[name].append(seconds_taken)
    for connection in connections.values():
      connection.client.close()
  finally:
    for server in servers.values():
      server.shutdown()
  out = {f"{name}_update_s": round(min(s), 3) for name, s in seconds.items()}
  out.update({f"{name}_bytes": n for name, n in nbytes.items()})
  out["int8_bytes_ratio"] = round(nbytes["int8_on_trainer"] / nbytes["float32"], 4)
  out["bfloat16_bytes_ratio"] = round(nbytes["bfloat16"] / nbytes["float32"], 4)
  out["int8_on_trainer_vs_on_sampler_s"] = round(min(seconds["int8_on_trainer"]) / min(seconds["int8_on_sampler"]), 3)
  return out


def mismatch(model, tokenizer, task, engine_config, max_new: int, prompts: int = PROMPTS) -> dict:
  """Each precision's sampler against the float32 trainer on the same sampled tokens; tokens/s per precision;
  the bytes a version moves at each precision over float32's."""
  graphdef, params = nnx.split(model)
  mesh = single_device_mesh(jax.devices()[0])
  engine = make_engine(graphdef, model.config, engine_config, mesh)
  rng = np.random.default_rng(20_000)
  prompts = [tokenizer.encode(task.sample(rng)[0]) for _ in range(prompts)]
  knobs = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=tokenizer.stop_ids)
  forward = jax.jit(lambda p, tokens, valid: token_logprobs(nnx.merge(graphdef, p)(tokens, valid), tokens)[0])
  out = {f"{p}_bytes_ratio": round(wire_bytes(encode(params, p)) / wire_bytes(encode(params, "float32")), 4)
         for p in PRECISIONS if p != "float32"}
  samplers = {p: StreamingSampler([engine], decode(encode(params, p))) for p in PRECISIONS}

  def sample(precision):
    for i, prompt in enumerate(prompts):
      samplers[precision].submit(prompt, knobs, group_id=i)  # the same keys for every precision
    start = time.perf_counter()
    samples = list(samplers[precision].stream())
    return time.perf_counter() - start, samples
  for precision in PRECISIONS:  # compiles every shape the timed runs meet
    sample(precision)
  best = {}
  for _ in range(TIMED):  # timed runs, precisions interleaved; the best counts
    for precision in PRECISIONS:
      seconds, samples = sample(precision)
      if precision not in best or seconds < best[precision][0]:
        best[precision] = (seconds, samples)
  for precision, (seconds, samples) in best.items():
    tokens = sum(s.num_tokens for s in samples)
    width = max(len(s.prompt_tokens) + s.num_tokens for s in samples)
    width = 1 << (width - 1).bit_length()
    ids, valid, mu, mask = (np.zeros((len(samples), width), d) for d in (np.int32, bool, np.float32, bool))
    for row, s in enumerate(samples):
      p, c = len(s.prompt_tokens), s.num_tokens
      ids[row, :p + c] = list(s.prompt_tokens) + list(s.completion_tokens)
      valid[row, :p + c], mask[row, p:p + c], mu[row, p:p + c] = True, True, s.logprobs
    pi = np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(valid)))
    d = (pi - mu)[mask]
    out[f"mismatch_kl_{precision}"] = float(np.mean(np.expm1(d) - d))
    out[f"mismatch_max_{precision}"] = round(float(np.abs(d).max()), 5)
    out[f"tokens_per_s_{precision}"] = round(tokens / seconds, 1)
  return out


def rl_arm(workdir: Path, warm: Path, precision: str, correction: str) -> dict:
  workdir.mkdir(parents=True)
  shutil.copytree(warm, workdir / "warmup_model")
  sets = ["PipelineConfig.mode='stream'", f"PipelineConfig.steps={STEPS}", f"SamplerConfig.precision='{precision}'",
          f"ObjectiveConfig.correction='{correction}'", f"JobConfig.eval_prompts={EVAL}"]
  command = [sys.executable, "-m", "streamrl_jax.cli", "train", "--workdir", str(workdir)]
  for binding in sets:
    command += ["--set", binding]
  done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=dict(os.environ, XLA_FLAGS=""))
  if done.returncode:
    raise RuntimeError(f"streamrl train ({precision}, {correction}) failed:\n{done.stdout[-2000:]}"
                       f"{done.stderr[-3000:]}")
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return dict(accuracy_before=summary["accuracy_before"], accuracy_after=summary["accuracy_after"],
              pipeline_mismatch_kl=float(np.mean([m["logprob_mismatch_kl"] for m in metrics])))


def main() -> dict:
  if QUICK:  # shapes the RL arms' processes (and this one) share compile once; compiles are never timed here
    cache = tempfile.mkdtemp(prefix="precision-bench-cache-")
    atexit.register(shutil.rmtree, cache, True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  out = dict(transfer())
  gin_config.parse(gin_config.run_files([]))
  config, job = gin_config.build_run()
  if WARMUP is not None:
    job = dataclasses.replace(job, warmup_steps=WARMUP)
  model, tokenizer, _ = job.load_model()
  task = job.make_task(tokenizer)
  print("precision: supervised warm-up of the demo model ...", file=sys.stderr, flush=True)
  model = supervised_warmup(model, tokenizer, task, job,
                            config.sampler.engine.max_prompt_length + config.max_new_tokens)
  measured = mismatch(model, tokenizer, job.make_task(tokenizer, "eval"), config.sampler.engine, config.max_new_tokens)
  out.update({k: v for k, v in measured.items() if not k.endswith("_bytes_ratio")})  # transfer()'s are SmolLM2's
  with tempfile.TemporaryDirectory() as tmp:
    warm = Path(tmp) / "warmup_model"
    save_hf(model, warm)
    arms = {}
    for name in RL_ARMS:
      precision, correction = ARMS[name]
      print(f"precision: RL arm {name} ({STEPS} steps) ...", file=sys.stderr, flush=True)
      arms[name] = rl_arm(Path(tmp) / name, warm, precision, correction)
  for name, arm in arms.items():
    out.update({f"{name}_{k}": round(v, 4) for k, v in arm.items()})
  if not arms:
    out["quick_omits"] = ["int8_accuracy_gap"]
    return out
  out["int8_accuracy_gap"] = round(arms["float32"]["accuracy_after"] - arms["int8"]["accuracy_after"], 4)
  if "int8_uncorrected" in arms:
    out["int8_uncorrected_accuracy_gap"] = round(arms["float32"]["accuracy_after"]
                                                 - arms["int8_uncorrected"]["accuracy_after"], 4)
  out.update(rl_steps=STEPS, eval_prompts=EVAL)
  return out


if __name__ == "__main__":
  from streamrl_jax import logs

  logs.configure(role="precision")  # the run's progress lines on stderr; the JSON alone on stdout
  if QUICK:  # as many CPU devices as the RL arms' processes have (one a core): they reuse this process's compiles
    from streamrl_jax.cli import default_host_devices, force_host_devices
    force_host_devices(default_host_devices())
  print(json.dumps(main()))
