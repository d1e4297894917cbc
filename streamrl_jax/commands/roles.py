"""`streamrl trainer` and `streamrl sampler`: the two roles of a run as separate programs; and `streamrl follower`,
a follower arm trained on the trainer's samples in a program of its own (`pipeline.follower_program`).

Both read the same gin files and `--set` bindings (the trainer refuses a sampler whose settings differ).
The trainer does what `streamrl train` does (warm-up, evaluation, metrics, checkpoints, `--resume`) and
serves its samplers over Arrow Flight; a sampler connects, takes leases until the run is over, and exits.
The trainer may span several processes (`--coordinator --num-processes --process-id`, or the environment
that JobSet and GKE set; see `streamrl_jax.distributed`); a sampler is one process per host.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_jax.config_types import ConfigError

if TYPE_CHECKING:  # the command imports jax (through the config) only when it runs
  from streamrl_jax.pipeline.config import PipelineConfig

_log = logging.getLogger(__name__)

ROLES = ("trainer", "sampler", "follower")


def add_role_parsers(sub, common) -> None:
  """The `trainer`, `sampler` and `follower` commands, each with its own options and its TLS group."""
  trainer, sampler = _trainer_parser(sub, common), _sampler_parser(sub, common)
  follower = sub.add_parser("follower", help="a follower arm of a run as its own program: trains on the lead "
                            "trainer's samples (ArmsConfig.programs)")
  common(follower)
  follower.add_argument("--connect", required=True, help="HOST:PORT of the lead trainer's server")
  follower.add_argument("--arm", required=True, metavar="FILE", help="the arm's gin file (its name is the file's)")
  follower.add_argument("--workdir", required=True, help="the arm's outputs: the lead's WORKDIR/arms/NAME, so that "
                        "`streamrl compare` finds them; run it again with the same workdir to resume the arm")
  follower.set_defaults(run=cmd_follower)
  tls_group(follower)
  for parser in (trainer, sampler):
    parser.add_argument("--site", default="", help="this program's datacenter label: each other site gets one copy of "
                        "every weight version across, from the trainer's site, and passes it on inside")
    tls_group(parser)
    dist = parser.add_argument_group("several processes in this role (jax.distributed)")
    dist.add_argument("--coordinator", help="HOST:PORT of this role's process 0")
    dist.add_argument("--num-processes", type=int, help="processes in this role (with --coordinator)")
    dist.add_argument("--process-id", type=int, help="this process's index among them, from 0 (with --coordinator)")


def tls_group(parser) -> None:
  tls = parser.add_argument_group("mutual TLS (all three, or none)")
  tls.add_argument("--tls-cert", help="this side's PEM certificate")
  tls.add_argument("--tls-key", help="this side's PEM private key")
  tls.add_argument("--tls-ca", help="PEM of the CA that signed the other side's certificate")


def _trainer_parser(sub, common):
  from streamrl_jax.commands.train import arms_arg

  trainer = sub.add_parser("trainer", help="the trainer of a run across processes: trains and serves its samplers")
  common(trainer)
  trainer.add_argument("--workdir", required=True, help="where metrics, pictures, checkpoints and models go")
  trainer.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve on (default loopback; port 0: "
                                                                "any free one, printed and written to --address-file)")
  arms_arg(trainer)
  trainer.add_argument("--address-file", help="write the address served on to this file once listening")
  trainer.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the workdir")
  trainer.add_argument("--auto-resume", action="store_true",
                       help="continue from the latest checkpoint if there is one, else start afresh (for restarts "
                            "by a cluster scheduler)")
  trainer.set_defaults(run=cmd_trainer)
  return trainer


def _sampler_parser(sub, common):
  sampler = sub.add_parser("sampler", help="a sampler of a run across processes: generates for a trainer")
  common(sampler)
  sampler.add_argument("--connect", required=True, help="HOST:PORT of the trainer's server")
  sampler.add_argument("--name", default=f"sampler-{os.getpid()}", help="how the trainer's logs and timeline call it")
  sampler.add_argument("--serve", metavar="HOST:PORT", help="also answer OpenAI-compatible requests "
                       "(/v1/chat/completions, ...) at HOST:PORT with this sampler's engine and newest weights "
                       "(model 'policy'; mutual TLS as Flight's when --tls-* are given; key: $STREAMRL_API_KEY)")
  sampler.add_argument("--serve-priority", default="before_leases", choices=["before_leases", "after_leases"],
                       help="with --serve: served requests go ahead of queued lease requests (default), or only "
                            "while none waits")
  sampler.add_argument("--relay-listen", help="HOST:PORT where this sampler serves the weight versions it holds to "
                       "other samplers (the broadcast tree; port 0 picks a free one); default: it serves none")
  sampler.add_argument("--relay-host", help="the host other samplers dial for this relay (when --relay-listen binds "
                       "0.0.0.0, e.g. the pod's IP)")
  sampler.add_argument("--relay-tls-name", help="with mutual TLS: the name relays' certificates carry, when it is not "
                       "the host dialled (one certificate for every sampler pod)")
  sampler.set_defaults(run=cmd_sampler)
  return sampler


def role_host_devices(args) -> int:
  """CPU devices to force for a role program: `MeshConfig.<role>_devices` (shared among the role's
  processes, from flags or the environment), else one per CPU core this process may run on."""
  from streamrl_jax import distributed, gin_config
  from streamrl_jax.meshes import MeshConfig

  gin_config.parse(gin_config.run_files(args.config), args.set)
  role = "trainer" if args.command == "follower" else args.command  # a follower arm is a trainer of its own
  wanted = getattr(gin_config.build(MeshConfig), f"{role}_devices")
  if not wanted:
    from streamrl_jax.resources import cpu_cores
    return cpu_cores()
  if args.command == "trainer" and args.arms:  # each follower arm on devices of its own, shaped as the trainer's
    wanted *= 1 + len(args.arms)
  cluster = distributed.detect(args.coordinator, args.num_processes, args.process_id)
  return -(-wanted // (cluster.num_processes if cluster else 1))


def _start_role(args):
  """Initialises the role's cluster, parses the configuration; (PipelineConfig, JobConfig, FlightConfig, TLS,
  settings)."""
  from streamrl_jax import distributed, gin_config
  from streamrl_jax.settings import flat_settings
  from streamrl_jax.streaming.flight_server import TLSFiles

  cluster = distributed.detect(args.coordinator, args.num_processes, args.process_id)
  if args.command == "sampler" and cluster is not None and cluster.num_processes > 1:
    raise ValueError("a sampler runs in one process: start one `streamrl sampler` per host (each host is a "
                     "sampler of its own); a sampler spanning several processes is not supported yet")
  tls = TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
  distributed.initialize(cluster)
  files = gin_config.run_files(args.config)
  gin_config.parse(files, args.set)
  config, job = gin_config.build_run()
  # What samplers are checked against: the lead's settings (arms train, not sample), with 'auto' precision as this
  # machine resolves it: a sampler whose machine resolves it otherwise is refused when it joins, never sent weights
  # it cannot read
  dtype = job.dtype()
  settings = flat_settings(config.resolved(dtype), job)
  if args.command == "trainer":
    config = gin_config.with_arms(config, job, args.arms, files, args.set)
  return config.resolved(dtype), job, gin_config.build_flight(), tls, settings


def cmd_trainer(args) -> int:
  from streamrl_jax.commands.train import run_training
  from streamrl_jax.pipeline.events import describe_event
  from streamrl_jax.pipeline.trainer.program import TrainerEndpoint, serve_training

  config, job, flight_config, tls, settings = _start_role(args)
  check_lora_base(config, job)
  events = Path(args.workdir) / "events.jsonl"

  def on_event(event: dict) -> None:  # samplers joining, leaving, lost: kept in WORKDIR/events.jsonl
    with events.open("a") as out:
      out.write(json.dumps(event) + "\n")
    _log.info(describe_event(event))

  def listening(address: str) -> None:
    _log.info("listening on %s", address)
    if args.address_file:
      Path(args.address_file).write_text(address)
  endpoint = TrainerEndpoint(args.listen, tls, flight_config, args.site, on_listening=listening, on_event=on_event)
  runner = functools.partial(serve_training, endpoint=endpoint, settings=settings)
  return run_training(args, config, job, runner, "streamrl trainer")


def check_lora_base(config: PipelineConfig, job) -> None:
  """With LoRA across processes every sampler loads the base itself (the trainer sends adapters only): a base the
  trainer changes before RL (the demo model's warm-up) is refused, in the trainer and in each sampler."""
  if config.trainer.lora.enabled and not job.model and job.warmup_steps > 0:
    raise ConfigError("LoraConfig.rank > 0 across processes: samplers load the base themselves, and the demo "
                      "model's warm-up changes it on the trainer only; set JobConfig.warmup_steps = 0 or name a "
                      "pretrained JobConfig.model")


def lora_base(config: PipelineConfig, job):
  """With LoRA, the base a sampler merges each version's adapters into, loaded as the trainer loads it."""
  if not config.trainer.lora.enabled:
    return None
  from flax import nnx

  check_lora_base(config, job)
  return nnx.split(job.load_model()[0])[1]


def cmd_follower(args) -> int:
  from streamrl_jax import gin_config
  from streamrl_jax.arms.program import follow_lead
  from streamrl_jax.streaming.flight_server import TLSFiles

  files = gin_config.run_files(args.config)
  gin_config.parse(files, args.set)
  config, job = gin_config.build_run()
  config = gin_config.with_arms(config, job, [args.arm], files, args.set).resolved(job.dtype())
  tls = TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
  name = config.arms.followers[0].name
  try:
    summary = follow_lead(config, job, name, connect=args.connect, workdir=Path(args.workdir), tls=tls,
                          flight_config=gin_config.build_flight())
  except KeyboardInterrupt:
    _log.warning("follower %s stopped; run it again with --workdir %s to resume from its last checkpoint", name,
                 args.workdir)
    return 130
  except ConnectionError as err:
    _log.error("follower %s: %s", name, err)
    return 3
  print(json.dumps({k: v for k, v in summary.items() if k != "counters"}))
  return 0


def cmd_sampler(args) -> int:
  import jax

  from streamrl_jax.pipeline import preflight
  from streamrl_jax.pipeline.sampler.program import SamplerEndpoint, run_sampler
  from streamrl_jax.stopping import StopRequest

  config, job, flight_config, tls, settings = _start_role(args)
  model_config, tokenizer = job.model_spec()
  task = job.make_task(tokenizer)
  preflight.check_devices(config, "sampler", len(jax.devices()))
  if jax.devices()[0].platform == "cpu":
    preflight.check_host_memory(config, model_config, "sampler", preflight.available_host_bytes())
  preflight.check_prompts(task, tokenizer, config.sampler.engine.max_prompt_length, job.seed)
  preflight.check_stops(config, tokenizer)
  preflight.check_rewards(config.sampler.reward, task, job.seed)
  config = preflight.check_lora(config, model_config, job.model, read_adapter=False)  # adapters come over Flight
  stop = StopRequest()  # the first Ctrl-C / SIGTERM: leave cleanly (leases handed back); the second: now
  try:
    with stop.installed(), stop.deferred("handing its leases back"):
      endpoint = SamplerEndpoint(args.connect, args.name, tls, flight_config, settings, args.site, args.relay_listen,
                                 args.relay_host, args.relay_tls_name, _serve_config(args.serve, args.serve_priority))
      stats = run_sampler(config, model_config, tokenizer, task, endpoint=endpoint, stop=stop.event,
                          base_params=lora_base(config, job))
  except KeyboardInterrupt:
    _log.warning("sampler %s stopped", args.name)
    return 130
  except ConnectionError as err:
    _log.error("sampler %s: %s", args.name, err)
    return 3
  if stop.requested:
    _log.warning("sampler %s stopped; its leases went back to the trainer", args.name)
    return 130
  _log.info(f"sampler {args.name}: the run is over; sent {stats['put_samples']} samples in {stats['put_shards']} "
            f"shards, fetched {stats['weights_fetches']} weight versions ({stats['weights_relay_fetches']} from a "
            f"relay, {stats['weights_relay_fallbacks']} relay fallbacks)")
  return 0


def _serve_config(address: str | None, priority: str = "before_leases"):
  """The `ServeConfig` of `--serve HOST:PORT` and `--serve-priority` (None: not served)."""
  if not address:
    return None
  from streamrl_jax.commands.serve import API_KEY_ENV
  from streamrl_jax.serving.config import ServeConfig
  from streamrl_jax.streaming.flight_config import parse_address

  host, port = parse_address(address, "--serve")
  return ServeConfig(host=host, port=port, api_key=os.environ.get(API_KEY_ENV, ""), priority=priority)
