"""The sampler as a service: HTTP against in-process throughput, time to the first streamed token, token ids that
survive the trip, and an agent program trained through it.

- `served_vs_inprocess`: SmolLM2-135M-Instruct (the package registry's GGUF), REQUESTS concurrent chat requests of
  MAX_TOKENS tokens (temperature 0.8, a seed each) sent through HTTP by the `openai` package's async client,
  against the same requests (same prompt ids, same seeds) submitted to the same `StreamingSampler` in process;
  generated tokens/s of each, interleaved REPEATS times after one untimed round of each: the ratio of medians.
- `token_ids_exact`: 1 when the token ids every response returned (`return_token_ids`) are, as a multiset, exactly
  the engine's samples of those requests.
- `stream_first_token_ms`: p50 over STREAMS concurrent streamed chat requests of the time from sending to the
  first chunk with text.
- `serve_ttft_vs_compute`: `streamrl serve --model MODEL` in its own process with its default flags, idle; one
  streamed chat request at a time (TTFT_TRIALS of them after one untimed): the median time from sending to the
  first chunk with text, over the median device time (`launch.device_clock`) of that request's prefill and first
  decode call (one step: the policy's for a lone request) on the same engine configuration in this process.
- `agent_accuracy_before` / `agent_accuracy_after`: the shipped agent example as docs/serving.md trains it
  (`streamrl train --config examples/agent/agent.gin`, AGENT_STEPS steps): held-out accuracy of one greedy episode
  per prompt before and after RL (the demo decoder warmed up on 3-digit products that call a calculator).

Prints one JSON object as its last line.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
REQUESTS, MAX_TOKENS, STREAMS = 64, 32, 16
REPEATS = size(3, 1)
TTFT_TRIALS, TTFT_TOKENS, START_TIMEOUT_S = size(8, 5), 8, 300
AGENT_STEPS = 8
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")


def questions() -> list[list[dict]]:
  return [[{"role": "user", "content": f"What is {11 + 7 * i} plus {23 + 5 * i}? Answer briefly."}]
          for i in range(REQUESTS)]


def in_process(sampler, tokenizer, chats) -> tuple[float, int]:
  """(seconds, generated tokens) of the requests submitted straight to the sampler."""
  from streamrl_jax.types import SamplingParams

  start = time.perf_counter()
  for i, chat in enumerate(chats):
    sampler.submit(tokenizer.apply_chat_template(chat), SamplingParams(
        temperature=0.8, max_new_tokens=MAX_TOKENS, stop_token_ids=tokenizer.stop_ids), group_id=i)
  tokens = sum(s.num_tokens for s in sampler.stream())
  return time.perf_counter() - start, tokens


async def served(base_url: str, chats) -> tuple[float, int, list]:
  """(seconds, generated tokens, each response's token ids) of the requests through HTTP, all at once."""
  import openai

  client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
  start = time.perf_counter()
  replies = await asyncio.gather(*(client.chat.completions.create(
      model=MODEL, messages=chat, max_tokens=MAX_TOKENS, temperature=0.8, seed=i,
      extra_body={"return_token_ids": True}) for i, chat in enumerate(chats)))
  elapsed = time.perf_counter() - start
  await client.close()
  return elapsed, sum(r.usage.completion_tokens for r in replies), [r.choices[0].token_ids for r in replies]


async def first_tokens(base_url: str, chats) -> list[float]:
  """Milliseconds from sending to the first chunk with text, of each streamed request."""
  import openai

  client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)

  async def one(chat):
    start = time.perf_counter()
    stream = await client.chat.completions.create(model=MODEL, messages=chat, max_tokens=MAX_TOKENS,
                                                  temperature=0.8, stream=True)
    first = None
    async for chunk in stream:
      if first is None and chunk.choices and chunk.choices[0].delta.content:
        first = (time.perf_counter() - start) * 1000
    return first
  out = await asyncio.gather(*(one(chat) for chat in chats))
  await client.close()
  return [x for x in out if x is not None]


def serving_figures() -> dict:
  from streamrl_jax.sampling import EngineConfig
  from streamrl_jax.serving.app import Service
  from streamrl_jax.serving.bridge import RequestBridge
  from streamrl_jax.serving.config import ServeConfig
  from streamrl_jax.serving.server import GenerationLoop, ServerThread
  from streamrl_jax.serving.standalone import load_served_model

  engine = EngineConfig(num_slots=REQUESTS, max_prompt_length=64, max_new_tokens=MAX_TOKENS, min_prefill_bucket=64,
                        steps_per_sync=4)
  model, sampler = load_served_model(MODEL, engine, name=MODEL)
  samples = []
  step = sampler.step

  def recorded_step():  # the engine's own record of what it sampled, to check the ids the responses carry
    out = step()
    samples.extend(out)
    return out
  sampler.step = recorded_step
  bridge = RequestBridge()
  server = ServerThread(Service(model, ServeConfig(port=0, max_requests=1024), bridge))
  chats, rates, exact = questions(), collections.defaultdict(list), True
  try:
    for round_ in range(REPEATS + 1):  # round 0 compiles every shape and is not counted
      seconds, tokens = in_process(sampler, model.tokenizer, chats)
      if round_:
        rates["inprocess"].append(tokens / seconds)
      samples.clear()
      loop = GenerationLoop(sampler, bridge)
      try:
        seconds, tokens, ids = asyncio.run(served(server.base_url, chats))
      finally:
        loop.stop()
      exact &= sorted(map(tuple, ids)) == sorted(tuple(s.completion_tokens.tolist()) for s in samples)
      if round_:
        rates["served"].append(tokens / seconds)
      print(f"round {round_}: in process {rates['inprocess'][-1:]}, served {rates['served'][-1:]} tokens/s",
            flush=True)
    loop = GenerationLoop(sampler, bridge)
    try:
      ttft = asyncio.run(first_tokens(server.base_url, chats[:STREAMS]))
    finally:
      loop.stop()
  finally:
    server.stop()
  inproc, serv = statistics.median(rates["inprocess"]), statistics.median(rates["served"])
  return dict(served_vs_inprocess=serv / inproc, served_tokens_s=serv, inprocess_tokens_s=inproc,
              token_ids_exact=int(exact), stream_first_token_ms=statistics.median(ttft),
              stream_first_token_ms_p90=sorted(ttft)[int(0.9 * (len(ttft) - 1))], streams=len(ttft),
              requests=REQUESTS, max_tokens=MAX_TOKENS, repeats=REPEATS)


def start_serve() -> tuple[subprocess.Popen, str]:
  """`streamrl serve --model MODEL` on a free port in its own process, its flags at their defaults; (process, base
  URL) once it has said where it listens."""
  proc = subprocess.Popen([sys.executable, "-m", "streamrl_jax.cli", "serve", "--model", MODEL, "--port", "0"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] and None, daemon=True).start()
  deadline, said = time.monotonic() + START_TIMEOUT_S, []
  while time.monotonic() < deadline and proc.poll() is None:
    try:
      said.append(lines.get(timeout=1.0))
    except queue.Empty:
      continue
    found = re.search(r"API at (\S+/v1)", said[-1])
    if found:
      return proc, found.group(1)
  stop(proc)
  raise RuntimeError(f"streamrl serve did not come up in {START_TIMEOUT_S} s:\n{''.join(said[-20:])}")


def stop(proc: subprocess.Popen) -> None:
  """Ctrl-C, then a kill if it has not ended within 30 s."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(timeout=30)


def lone_first_token_ms(base_url: str, chat) -> float:
  """Milliseconds from sending one streamed chat request to its first chunk with text (the server otherwise idle)."""
  import openai

  client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=120)
  start, first = time.perf_counter(), None
  for chunk in client.chat.completions.create(model=MODEL, messages=chat, max_tokens=TTFT_TOKENS, temperature=0.8,
                                              stream=True):
    if first is None and chunk.choices and chunk.choices[0].delta.content:
      first = (time.perf_counter() - start) * 1000
  client.close()
  if first is None:
    raise RuntimeError("a streamed response carried no text")
  return first


def first_token_compute_ms(chats) -> tuple[list[float], list[float]]:
  """(device ms, wall ms) of each chat's first sampler step in this process, on `streamrl serve`'s default engine:
  its prefill and first decode call, every program timed by the device clock."""
  from streamrl_jax import launch
  from streamrl_jax.cli import build_parser
  from streamrl_jax.commands.serve import engine_config
  from streamrl_jax.serving.standalone import load_served_model
  from streamrl_jax.types import SamplingParams

  model, sampler = load_served_model(MODEL, engine_config(build_parser().parse_args(["serve", "--model", MODEL])),
                                     name=MODEL)
  device, wall = [], []
  for chat in chats:
    sampler.submit(model.tokenizer.apply_chat_template(chat), SamplingParams(
        temperature=0.8, max_new_tokens=TTFT_TOKENS, stop_token_ids=model.tokenizer.stop_ids))
    with launch.device_clock() as clock:
      start = time.perf_counter()
      sampler.step()
      wall.append((time.perf_counter() - start) * 1000)
    if "_generate_impl" not in clock.launches:
      raise RuntimeError(f"the first step ran no decode call: {dict(clock.launches)}")
    device.append(clock.total_device_s * 1000)
    list(sampler.stream())
  return device[1:], wall[1:]  # the first compiled


def ttft_figures() -> dict:
  chats = questions()[:TTFT_TRIALS + 1]
  proc, base_url = start_serve()
  try:
    ttft = [lone_first_token_ms(base_url, chat) for chat in chats][1:]  # the first compiled
  finally:
    stop(proc)
  device, wall = first_token_compute_ms(chats)
  return dict(serve_ttft_vs_compute=statistics.median(ttft) / statistics.median(device),
              serve_ttft_ms=statistics.median(ttft), first_token_device_ms=statistics.median(device),
              first_token_inprocess_ms=statistics.median(wall), ttft_trials=len(ttft))


def agent_figures() -> dict:
  """docs/serving.md's agent training command, AGENT_STEPS steps, in its own process."""
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "streamrl_jax.cli", "train", "--config", "examples/agent/agent.gin",
                          "--workdir", workdir, "--set", f"PipelineConfig.steps={AGENT_STEPS}"], cwd=ROOT,
                         capture_output=True, text=True)
    if run.returncode:
      raise RuntimeError(f"the agent run failed ({run.returncode}):\n{run.stderr[-3000:]}")
    summary = json.loads((Path(workdir) / "summary.json").read_text())
    metrics = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return dict(agent_accuracy_before=summary["accuracy_before"], agent_accuracy_after=summary["accuracy_after"],
              agent_steps=AGENT_STEPS, agent_run_s=time.perf_counter() - start,
              agent_train_reward_first=metrics[0]["reward_mean"], agent_train_reward_last=metrics[-1]["reward_mean"],
              agent_env_tokens_last=metrics[-1].get("env_tokens"))


def main() -> None:
  out = serving_figures()
  out.update(ttft_figures())
  if QUICK:  # the agent's run is a full run's (tests/test_shipped_configs.py runs its config every CI run)
    out["quick_omits"] = ["agent_accuracy_before", "agent_accuracy_after"]
  else:
    out.update(agent_figures())
  print(json.dumps(out))


if __name__ == "__main__":
  main()
