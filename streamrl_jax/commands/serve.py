"""`streamrl serve`: the OpenAI-compatible server in front of a model's continuous-batching engine."""

from __future__ import annotations

import os

API_KEY_ENV = "STREAMRL_API_KEY"


def add_serve_parser(sub) -> None:
  serve = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/models, /v1/completions, "
                         "/v1/chat/completions) in front of the continuous-batching engine")
  serve.add_argument("--model", required=True, help="a catalog name (smollm2-135m-instruct), a .gguf file, a "
                     "Hugging Face directory or a Hub id (org/name[@revision])")
  serve.add_argument("--name", default="", help="the model id clients ask for (default: --model as given)")
  serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
  serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)")
  serve.add_argument("--api-key", default=None, help=f"callers must send this key (default: ${API_KEY_ENV}; "
                     "unset: no key)")
  serve.add_argument("--slots", type=int, default=32, help="sequences decoded at once (default 32)")
  serve.add_argument("--max-prompt-tokens", type=int, default=512, help="longest prompt accepted (default 512)")
  serve.add_argument("--max-tokens", type=int, default=256, help="most tokens one completion may ask for "
                     "(default 256)")
  serve.add_argument("--max-requests", type=int, default=256, help="requests accepted at once; more get 429 "
                     "(default 256)")
  serve.add_argument("--steps-per-sync", type=int, default=4, help="most decode steps per host round trip "
                     "(default 4; a request's first token still leaves after one)")
  serve.add_argument("--kv-layout", default="contiguous", choices=["contiguous", "paged"],
                     help="the KV cache's layout (default contiguous; paged on accelerators)")
  serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype")
  serve.add_argument("--seed", type=int, default=0, help="root seed of requests that give none")
  serve.add_argument("--tls-cert", default=None, help="mutual TLS: this server's certificate (PEM)")
  serve.add_argument("--tls-key", default=None, help="mutual TLS: its key (PEM)")
  serve.add_argument("--tls-ca", default=None, help="mutual TLS: the CA that signs clients' certificates (PEM)")
  serve.set_defaults(run=cmd_serve)


def engine_config(args):
  """The `EngineConfig` of a `streamrl serve` command line's flags."""
  from streamrl_jax.sampling import EngineConfig

  return EngineConfig(num_slots=args.slots, max_prompt_length=args.max_prompt_tokens, max_new_tokens=args.max_tokens,
                      min_prefill_bucket=min(64, args.max_prompt_tokens), kv_layout=args.kv_layout,
                      steps_per_sync=args.steps_per_sync)


def cmd_serve(args) -> int:
  import uvicorn

  from streamrl_jax.serving.app import Service
  from streamrl_jax.serving.bridge import RequestBridge
  from streamrl_jax.serving.config import ServeConfig
  from streamrl_jax.serving.server import GenerationLoop, bind, uvicorn_config
  from streamrl_jax.serving.standalone import load_served_model
  from streamrl_jax.streaming.flight_server import TLSFiles

  tls = TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
  config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV, ""),
                       model_name=args.name or args.model, max_requests=args.max_requests, max_tokens=args.max_tokens)
  sock = bind(config.host, config.port)  # before the model loads: a port in use fails at once
  served, sampler = load_served_model(args.model, engine_config(args), dtype=args.dtype, seed=args.seed, name=config.model_name)
  bridge = RequestBridge(before_leases=True)
  service = Service(served, config, bridge)
  loop = GenerationLoop(sampler, bridge)
  scheme = "https" if tls else "http"
  host = f"[{config.host}]" if ":" in config.host else config.host
  print(f"OpenAI-compatible API at {scheme}://{host}:{sock.getsockname()[1]}/v1 (model {served.name!r}"
        f"{', key required' if config.api_key else ''}); Ctrl-C stops", flush=True)
  try:
    uvicorn.Server(uvicorn_config(service, tls)).run(sockets=[sock])  # a Ctrl-C shuts it down, then is raised again
  except KeyboardInterrupt:
    pass
  finally:
    loop.stop()
    sock.close()
  print(f"streamrl serve: stopped ({bridge.counters.served_requests} requests, "
        f"{bridge.counters.served_tokens} tokens served)", flush=True)
  return 0
