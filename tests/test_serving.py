"""The OpenAI-compatible server, with the real `openai` package as its client, against a served tiny model on a free
port: completions equal the in-process engine's at temperature 0, streamed text equals the whole text, seeds
reproduce, stop strings cut, every bad request gets an OpenAI error body with its status, and no abuse leaks a slot
or a page."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np
import pytest

from streamrl_jax.serving.bridge import Cancel, Finished, Generate, RequestBridge
from streamrl_jax.serving.config import ServeConfig
from streamrl_jax.types import SamplingParams
from tests.serving_setup import API_KEY, MODEL, client, leaks, running_server, tiny_model_dir, wait_idle
from tests.xla_flags import xla_flags

try:  # the HTTP client the `openai` package is built on: httpx2 from openai 3, httpx before
  import httpx2 as httpx
except ImportError:
  import httpx

CHATS = [[{"role": "user", "content": "the cat sat"}], [{"role": "system", "content": "be brief"},
                                                         {"role": "user", "content": "hello there"}]]
TEXT = "in the beginning"
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def served(model_dir):
  """(service, sampler, server, reference): `reference[i]` is the in-process engine's greedy tokens for CHATS[i]
  (and "text" for TEXT), generated on the same sampler before the server took it, one request at a time."""
  reference = {}

  def generate_in_process(sampler, model):
    tokenizer = model.tokenizer
    prompts = {i: tokenizer.apply_chat_template(chat) for i, chat in enumerate(CHATS)}
    prompts["text"] = tokenizer.encode_prompt(TEXT)
    for key, prompt in prompts.items():
      sampler.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=GREEDY_TOKENS,
                                            stop_token_ids=tokenizer.stop_ids))
      (sample,) = list(sampler.stream())
      reference[key] = (list(prompt), sample.completion_tokens.tolist())
  with running_server(model_dir, before_start=generate_in_process) as (service, sampler, server, loop):
    yield service, sampler, server, reference, loop


def _http(server, **kwargs):
  return httpx.Client(base_url=server.base_url, timeout=60, **kwargs)


def test_completions_equal_the_in_process_engines_at_temperature_0(served):
  service, _, server, reference, _ = served
  tokenizer = service.model.tokenizer
  openai_client = client(server)
  for i, chat in enumerate(CHATS):
    reply = openai_client.chat.completions.create(model=MODEL, messages=chat, max_tokens=GREEDY_TOKENS, temperature=0,
                                                  extra_body={"return_token_ids": True})
    prompt, tokens = reference[i]
    choice = reply.choices[0]
    assert reply.prompt_token_ids == prompt
    assert choice.token_ids == tokens
    ended = tokens[:-1] if tokens[-1] in tokenizer.stop_ids else tokens
    assert choice.message.content == tokenizer.decode(ended)
    assert choice.finish_reason == ("stop" if tokens[-1] in tokenizer.stop_ids else "length")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(tokens)
    assert reply.weight_version == 0 and choice.token_versions == [0] * len(tokens)
  text = openai_client.completions.create(model=MODEL, prompt=TEXT, max_tokens=GREEDY_TOKENS, temperature=0,
                                          logprobs=1, extra_body={"return_token_ids": True})
  assert text.choices[0].token_ids == reference["text"][1]
  assert len(text.choices[0].logprobs.token_logprobs) == len(reference["text"][1])
  assert all(lp <= 0 for lp in text.choices[0].logprobs.token_logprobs)


def test_streamed_text_equals_the_whole_text(served):
  _, _, server, _, _ = served
  openai_client = client(server)
  for chat in CHATS:
    whole = openai_client.chat.completions.create(model=MODEL, messages=chat, max_tokens=20, temperature=0)
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=chat, max_tokens=20, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
  streamed = "".join(c.choices[0].text for c in openai_client.completions.create(
      model=MODEL, prompt=TEXT, max_tokens=20, temperature=0, stream=True))
  assert streamed == openai_client.completions.create(model=MODEL, prompt=TEXT, max_tokens=20,
                                                      temperature=0).choices[0].text


def test_a_seed_reproduces_sampled_choices_and_choices_differ(served):
  _, _, server, _, _ = served
  openai_client = client(server)
  ask = dict(model=MODEL, messages=CHATS[0], max_tokens=12, temperature=1.0, n=3, seed=7,
             extra_body={"return_token_ids": True})
  first, second = openai_client.chat.completions.create(**ask), openai_client.chat.completions.create(**ask)
  assert [c.token_ids for c in first.choices] == [c.token_ids for c in second.choices]
  assert len({tuple(c.token_ids) for c in first.choices}) > 1  # a random tiny model: three draws of 12 tokens


def test_a_stop_string_ends_the_choice_before_it(served):
  _, _, server, reference, _ = served
  openai_client = client(server)
  whole = openai_client.completions.create(model=MODEL, prompt=TEXT, max_tokens=GREEDY_TOKENS, temperature=0)
  text = whole.choices[0].text
  clean = [i for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2] and text[i:i + 2] not in text[:i]]
  assert clean, f"no usable stop string in {text!r}"
  stop = text[clean[0]:clean[0] + 2]
  cut = openai_client.completions.create(model=MODEL, prompt=TEXT, max_tokens=GREEDY_TOKENS, temperature=0, stop=[stop],
                                         extra_body={"return_token_ids": True})
  assert cut.choices[0].text == text[:clean[0]]
  assert cut.choices[0].finish_reason == "stop"
  assert cut.choices[0].token_ids == reference["text"][1][:len(cut.choices[0].token_ids)]  # a prefix, cut early
  assert len(cut.choices[0].token_ids) < len(reference["text"][1])


def _post(http, path: str, body, headers=None) -> httpx.Response:
  headers = {"authorization": f"Bearer {API_KEY}", **(headers or {})}
  data = body if isinstance(body, (bytes, str)) else json.dumps(body)
  return http.post(path, content=data, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("path,body,headers,status,param", [
    ("/chat/completions", {"model": MODEL, "messages": CHATS[0]}, {"authorization": "Bearer wrong"}, 401, None),
    ("/chat/completions", b"{not json", None, 400, None),
    ("/chat/completions", {"model": "gpt-4", "messages": CHATS[0]}, None, 404, "model"),
    ("/chat/completions", {"model": MODEL, "messages": CHATS[0], "temperature": "hot"}, None, 400, "temperature"),
    ("/chat/completions", {"model": MODEL, "messages": CHATS[0], "n": 99}, None, 400, "n"),
    ("/chat/completions", {"model": MODEL, "messages": CHATS[0], "frobnicate": 1}, None, 400, "frobnicate"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("/chat/completions", {"model": MODEL, "messages": CHATS[0], "max_tokens": 1000}, None, 400, "max_tokens"),
    ("/completions", {"model": MODEL, "prompt": "the cat " * 40}, None, 400, "prompt"),
    ("/completions", {"model": MODEL, "prompt": ["a", "b"]}, None, 400, "prompt"),
    ("/chat/completions", {"model": MODEL, "messages": CHATS[0]}, {"x-streamrl-episode": "nobody"}, 400,
     "x-streamrl-episode"),
    ("/completions", {"model": MODEL, "prompt": "x" * 2_000_000}, None, 413, None),
])
def test_a_bad_request_gets_an_openai_error_body_and_the_server_keeps_serving(served, path, body, headers, status,
                                                                              param):
  service, sampler, server, _, _ = served
  with _http(server) as http:
    reply = _post(http, path, body, headers)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["param"] == param
    ok = _post(http, "/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
  wait_idle(service, sampler)
  assert leaks(sampler) == dict(slots=0, parked=0, pages=0)


def test_an_unknown_route_is_an_openai_error(served):
  _, _, server, _, _ = served
  with _http(server) as http:
    reply = http.get("/embeddings")
  assert reply.status_code == 404 and "error" in reply.json()


def test_a_client_that_leaves_mid_stream_and_a_thousand_requests_at_once_leak_nothing(served):
  service, sampler, server, _, loop = served
  with _http(server) as http:
    body = {"model": MODEL, "messages": CHATS[1], "max_tokens": 24, "temperature": 1.0, "stream": True}
    with http.stream("POST", "/chat/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"}) as reply:
      assert reply.status_code == 200
      next(reply.iter_lines())  # the first event, then the client goes away

  async def flood():
    """1000 requests while the loop is held: the bound's worth wait in the bridge, every other one is answered
    429 at once; then the loop goes on and the waiting ones finish."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
      body = {"model": MODEL, "prompt": TEXT, "max_tokens": 8, "temperature": 1.0}
      with loop.held():
        tasks = [asyncio.ensure_future(http.post("/completions", json=body, headers={
            "authorization": f"Bearer {API_KEY}"})) for _ in range(1000)]
        refused = 1000 - service.config.max_requests
        for _ in range(2400):  # at most 120 s
          if sum(t.done() for t in tasks) >= refused:
            break
          await asyncio.sleep(0.05)
      replies = await asyncio.gather(*tasks)
    return [r.status_code for r in replies], [r.json() for r in replies]
  codes, bodies = asyncio.run(flood())
  assert codes.count(200) == service.config.max_requests and codes.count(429) == 1000 - service.config.max_requests
  assert all(b["error"]["code"] == "rate_limit_exceeded" for c, b in zip(codes, bodies) if c == 429)
  wait_idle(service, sampler)
  assert leaks(sampler) == dict(slots=0, parked=0, pages=0)
  after = client(server).completions.create(model=MODEL, prompt=TEXT, max_tokens=4)
  assert after.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def by_hand(model_dir):
  """A second sampler of the served model, driven by the test's own hand (no loop, no server)."""
  from streamrl_jax.serving.standalone import load_served_model
  from tests.serving_setup import ENGINE

  return load_served_model(str(model_dir), ENGINE)


def test_a_cancel_frees_the_rows_of_a_request_mid_generation(by_hand):
  """The bridge's cancel path, driven by hand: a request cancelled while its rows decode leaves no slot, page or
  queued request behind, and sends nothing after the cancel."""
  served_model, sampler = by_hand
  events, cancelled = [], sampler.counters["cancelled"]
  bridge = RequestBridge()
  prompt = np.asarray(served_model.tokenizer.encode_prompt(TEXT), np.int32)
  bridge.post(Generate(1, prompt, SamplingParams(temperature=1.0, max_new_tokens=24, num_samples=3), None,
                       events.append))
  bridge.pump(sampler)
  for _ in range(3):
    bridge.deliver(sampler, sampler.step())
  finished = sum(isinstance(e, Finished) for e in events)
  assert sampler.num_in_flight == 3 - finished > 0 and bridge.busy
  bridge.post(Cancel(1))
  bridge.pump(sampler)
  seen = len(events)
  assert not sampler.has_work() and not bridge.busy
  assert leaks(sampler) == dict(slots=0, parked=0, pages=0)
  assert sampler.counters["cancelled"] - cancelled == bridge.counters["served_cancelled"] == 3 - finished
  bridge.deliver(sampler, sampler.step())
  assert len(events) == seen


def test_served_requests_go_ahead_of_queued_lease_requests_or_wait_for_them(by_hand):
  """`before_leases`: a served request is admitted ahead of lease requests already queued; `after_leases`: it is
  handed to the sampler only once no other request waits."""
  from tests.serving_setup import ENGINE

  model, sampler = by_hand
  prompt = np.asarray(model.tokenizer.encode_prompt(TEXT), np.int32)
  lease = SamplingParams(temperature=1.0, max_new_tokens=24)
  for before in (True, False):
    bridge, events = RequestBridge(before_leases=before), []
    leased = sampler.submit(prompt, dataclasses.replace(lease, num_samples=ENGINE.num_slots + 2))  # 2 wait
    bridge.post(Generate(7, prompt, SamplingParams(temperature=1.0, max_new_tokens=4), None, events.append))
    bridge.pump(sampler)
    bridge.deliver(sampler, sampler.step())
    served = bridge.request_ids
    assert bool(served) == before
    if before:  # in a slot; two lease requests still queued
      assert sampler.num_pending == 3 and set(sampler.progress(dict.fromkeys(served, 0))) == set(served)
    while sampler.has_work() or bridge.busy:
      bridge.pump(sampler)
      if not before and bridge.request_ids:
        assert sampler.num_pending <= 1  # handed over only once the lease queue had drained
      bridge.deliver(sampler, sampler.step())
    assert any(isinstance(e, Finished) for e in events) and len(leased) == ENGINE.num_slots + 2


def test_mutual_tls_admits_a_client_with_a_certificate_and_refuses_one_without(tmp_path_factory, model_dir):
  import openai

  from streamrl_jax.streaming.flight_server import TLSFiles
  from tests.tls_certs import write_test_certificates

  pem = write_test_certificates(tmp_path_factory.mktemp("tls"))
  tls = TLSFiles(str(pem["server_cert"]), str(pem["server_key"]), str(pem["ca"]))
  config = ServeConfig(port=0)
  with running_server(model_dir, config=config, tls=tls) as (_, _, server, _):
    assert server.base_url.startswith("https://")
    import ssl
    context = ssl.create_default_context(cafile=str(pem["ca"]))
    context.load_cert_chain(str(pem["client_cert"]), str(pem["client_key"]))
    good = httpx.Client(verify=context)
    models = openai.OpenAI(base_url=server.base_url, api_key="-", http_client=good, max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]
    bare = httpx.Client(verify=ssl.create_default_context(cafile=str(pem["ca"])))
    with pytest.raises(openai.APIConnectionError):
      openai.OpenAI(base_url=server.base_url, api_key="-", http_client=bare, max_retries=0).models.list()


def test_streamrl_serve_answers_the_openai_client_and_stops_cleanly_on_ctrl_c(model_dir):
  """The command as a user runs it: a free port, a key from the environment, one answer, Ctrl-C: exit 0."""
  import os
  import re
  import signal
  import subprocess
  import sys
  import threading

  import openai

  env = dict(os.environ, STREAMRL_API_KEY="from-env", XLA_FLAGS=xla_flags(devices=1))
  proc = subprocess.Popen([sys.executable, "-m", "streamrl_jax.cli", "serve", "--model", str(model_dir), "--name",
                           MODEL, "--port", "0", "--slots", "2", "--max-prompt-tokens", "64", "--max-tokens", "8"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  try:
    lines, found = [], threading.Event()

    def read():
      for line in proc.stdout:
        lines.append(line)
        if "OpenAI-compatible API at" in line:
          found.set()
    threading.Thread(target=read, daemon=True).start()
    assert found.wait(120), "".join(lines)
    url = re.search(r"(http://\S+/v1)", "".join(lines)).group(1)
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    reply = openai.OpenAI(base_url=url, api_key="from-env", max_retries=0, timeout=60).completions.create(
        model=MODEL, prompt=TEXT, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, "".join(lines)
    assert "Traceback" not in "".join(lines) and "stopped (1 requests" in "".join(lines)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)


@pytest.mark.slow
def test_a_sampler_program_serves_clients_with_the_newest_weights_while_it_trains(tmp_path):
  """`streamrl sampler --serve`: a trainer and a sampler as processes; while the run trains, a client's requests to
  the sampler are answered with the weights that have landed there; the run still trains each step once."""
  import re

  from tests.processes import Programs, check_each_step_once, free_port

  steps, programs = 3, Programs(tmp_path, steps=3, mode="async")
  port = free_port()
  try:
    programs.start("trainer", "trainer")
    programs.start("sampler", "s0", "--serve", f"127.0.0.1:{port}")
    programs.wait_until(lambda: "OpenAI-compatible API at" in programs.logs["s0"].read_text(), "the sampler's server")
    url = re.search(r"(http://\S+/v1)", programs.logs["s0"].read_text()).group(1)
    api = client(type("S", (), {"base_url": url})())
    versions = []
    for _ in range(600):  # until its weights land; then a few answers while the run goes on (at most 60 s)
      try:
        reply = api.completions.create(model="policy", prompt="12+34=", max_tokens=4, temperature=1.0)
      except Exception as err:  # noqa: BLE001 - 503 until the first weights land; the run may end meanwhile
        if "no weights have landed" not in str(err):
          break
        time.sleep(0.1)
        continue
      versions.append(reply.weight_version)
      if len(versions) >= 3:
        break
    assert versions and set(versions) <= set(range(steps + 1)), (versions, programs.tails())  # versions published
    assert versions == sorted(versions)  # answered with the newest weights that landed, never older ones
    assert programs.wait_exit("trainer") == 0, programs.tails()
    assert programs.wait_exit("s0") == 0, programs.tails()
    check_each_step_once(tmp_path, steps)
  finally:
    programs.kill_all()
