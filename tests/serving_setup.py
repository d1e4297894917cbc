"""A served tiny model for the serving tests: a GGUF written here (ChatML template, byte-level BPE), converted once,
loaded into a paged engine, behind a server on a free port with its generation loop."""

from __future__ import annotations

import contextlib
import dataclasses
import time

from streamrl_jax.sampling import EngineConfig
from streamrl_jax.serving.app import Service
from streamrl_jax.serving.bridge import RequestBridge
from streamrl_jax.serving.config import ServeConfig
from streamrl_jax.serving.server import GenerationLoop, ServerThread
from streamrl_jax.serving.standalone import load_served_model

ENGINE = EngineConfig(num_slots=4, max_prompt_length=64, max_new_tokens=24, min_prefill_bucket=64, kv_layout="paged",
                      page_size=8, prefill_batch=4)
API_KEY = "test-key"
MODEL = "tiny"


def tiny_model_dir(tmp_path_factory):
  from streamrl_jax.models.gguf import convert
  from tests.gguf_files import write_gguf

  root = tmp_path_factory.mktemp("served")
  return convert(write_gguf(root / "tiny.gguf"), root / "hf")


@contextlib.contextmanager
def running_server(model_dir, *, config: ServeConfig = ServeConfig(port=0, api_key=API_KEY, max_requests=16, max_n=4),
                   engine: EngineConfig = ENGINE, tls=None, before_start=None):
  """(service, sampler, server, generation loop) of a served tiny model; `before_start(sampler, served)` runs on the idle sampler
  before the generation loop takes it (an in-process reference)."""
  served, sampler = load_served_model(str(model_dir), engine, name=MODEL)
  if before_start is not None:
    before_start(sampler, served)
  bridge = RequestBridge()
  service = Service(served, config, bridge)
  loop = GenerationLoop(sampler, bridge)
  server = None
  try:
    server = ServerThread(service, tls=tls)
    yield service, sampler, server, loop
  finally:
    if server is not None:
      server.stop()
    loop.stop()


def wait_idle(service, sampler, timeout: float = 60.0) -> None:
  """Until no served request is live and the sampler holds no work (the loop has taken every cancel in)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if not service.bridge.busy and not sampler.has_work() and service.active == 0:
      return
    time.sleep(0.05)
  raise TimeoutError(f"the server did not go idle in {timeout} s: {service.bridge.live_requests} requests live, "
                     f"{sampler.num_in_flight} in flight, {sampler.num_pending} queued")


def leaks(sampler) -> dict:
  """Busy slots, parked rows and pages not free (the prefix cache's given back first) of every instance."""
  out = dict(slots=0, parked=0, pages=0)
  for inst in sampler._instances:
    out["slots"] += len(inst.slots)
    out["parked"] += len(inst.parked)
    engine = inst.engine
    if hasattr(engine, "free_pages"):
      out["pages"] += engine.num_pages - engine.free_pages(engine.drop_prefix_cache(inst.state))
  return out


def client(server, **kwargs):
  import openai

  return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120, **kwargs)


def replace(config: ServeConfig, **changes) -> ServeConfig:
  return dataclasses.replace(config, **changes)
