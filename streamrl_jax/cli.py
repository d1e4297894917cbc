"""The `streamrl` command.

  streamrl config [--config FILE] [--set BINDING] every key of the resolved configuration, as a gin file
  streamrl info [--config FILE] [--set BINDING]   devices, versions, and the mesh split a config gives
  streamrl generate [--model M] [--prompt TEXT]    batch generation through the KV cache (--chat: chat template)
  streamrl serve --model M [--port P]             an OpenAI-compatible server in front of the engine
  streamrl convert IN.gguf OUT_DIR                 a GGUF file to a Hugging Face directory
  streamrl train --workdir DIR [--config FILE]    RL post-training in one program (default: the CPU demo)
  streamrl trainer --workdir DIR [--listen H:P]    the trainer of a run across processes; serves samplers
  streamrl sampler --connect H:P                   a sampler of a run across processes
  streamrl follower --connect H:P --arm A.gin      a follower arm of a run as its own program
  streamrl scorer --stage judge [--listen H:P]     a teacher's or judge's stage as a program of its own
  streamrl launch local --workdir DIR --samplers N one trainer and N sampler processes on this machine
  streamrl train --workdir DIR --arms A.gin B.gin  several algorithms trained on one sample stream
  streamrl compare RUN_DIR                         those arms side by side: a table and RUN_DIR/compare.png
  streamrl simulate --preset NAME --out DIR       the pipeline at cluster scale: results.json and plots
  streamrl plan --model M --topology v5p:4x4x2    a run compiled for a TPU slice: fits? how fast? which split?
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import signal
import sys
import time
from pathlib import Path

from streamrl_jax import logs, stopping
from streamrl_jax.commands.host_devices import shared_mesh, default_host_devices, force_host_devices
from streamrl_jax.host_memory import limit_fragmentation
from streamrl_jax.resources import cpu_cores

DEMO_PROMPTS = ("12+34=", "7*8=", "100-1=", "(2+3)*4=")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "gin-config",
            "safetensors", "tokenizers", "pyarrow")


def _versions() -> dict[str, str]:
  out = {}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


def cmd_info(args) -> int:
  import jax

  from streamrl_jax import gin_config
  from streamrl_jax.meshes import CPU_DEVICES_RULE, MeshConfig, cpu_device_count

  gin_config.parse(gin_config.run_files(args.config), args.set)
  mesh_config, job = gin_config.build(MeshConfig), gin_config.build_job()
  devices = jax.devices()
  info = {"python": sys.version.split()[0], "versions": _versions(), "backend": jax.default_backend(),
          "process_count": jax.process_count(), "device_count": len(devices),
          "devices": sorted({d.device_kind for d in devices}), "mesh_config": mesh_config.__dict__,
          "compute_dtype": {"JobConfig.compute_dtype": job.compute_dtype, **job.compute_choice().as_dict(),
                            "weights_and_optimizer": "float32"}}
  if info["backend"] == "cpu":  # what `streamrl train` of this config forces, and each computation's threads
    info["cpu_devices"] = {"train": cpu_device_count(mesh_config, shared_mesh(), cpu_cores()),
                           "threads_per_device": cpu_cores(), "rule": CPU_DEVICES_RULE}
  try:
    sampler, trainer = mesh_config.split(len(devices))
    info["sampler_mesh"], info["trainer_mesh"] = sampler.as_dict(), trainer.as_dict()
  except ValueError as err:
    info["mesh_error"] = str(err)
  print(json.dumps(info, indent=2))
  return 0


def cmd_config(args) -> int:
  from streamrl_jax import gin_config

  files = gin_config.run_files(args.config)
  gin_config.parse(files, args.set)
  print(gin_config.resolved_text(config_header(files, args.set)), end="")
  return 0


def config_header(files, bindings) -> str:
  """The first lines of a resolved configuration: what it was resolved from, and how to use it."""
  made = " ".join([*(f"--config {f}" for f in files), *(f"--set {b!r}" for b in bindings)])
  return ("The resolved configuration of streamrl_jax, every key with its type and help, from\n"
          f"  {made}\nSaved to a file, it is a --config that builds the same run.")


def _demo_model(seed: int):
  from flax import nnx

  from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer

  tokenizer = CharTokenizer()
  config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, eos_token_id=tokenizer.eos_id)
  return Transformer(config, rngs=nnx.Rngs(seed)), tokenizer


def cmd_tasks(args) -> int:
  from streamrl_jax.tasks.listing import lines

  print("\n".join(lines()))
  return 0


def cmd_generate(args) -> int:
  import jax.numpy as jnp

  from streamrl_jax.models import generate, load_hf, load_tokenizer, pad_prompts
  from streamrl_jax.models.catalog import resolve_model

  if args.model:
    path = resolve_model(args.model)
    model, tokenizer = load_hf(path, dtype=jnp.dtype(args.dtype)), load_tokenizer(path)
    source = args.model
  else:
    model, tokenizer = _demo_model(args.seed)
    source = "a tiny random model (untrained: expect gibberish)"
  prompts = args.prompt or list(DEMO_PROMPTS)
  if args.chat:
    if not tokenizer.chat_template:
      raise ValueError(f"--chat: the model {source!r} has no chat template")
    system = [{"role": "system", "content": args.system}] if args.system else []
    encoded = [tokenizer.apply_chat_template(system + [{"role": "user", "content": p}]) for p in prompts]
  else:
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
  tokens, mask = pad_prompts(encoded, tokenizer.pad_id, side="left")
  print(f"model: {source}; {model.config.param_count():,} parameters; {len(prompts)} prompts")
  start = time.perf_counter()
  out = generate(model, tokens, mask, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
  compiled = time.perf_counter()
  out = generate(model, tokens, mask, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
  elapsed = time.perf_counter() - compiled
  counted, ended_at_once = 0, 0
  for prompt, completion in zip(prompts, out):
    completion = completion.tolist()
    stops = [i for i, token in enumerate(completion) if token in tokenizer.stop_ids]
    ended = completion[:stops[0]] if stops else completion
    counted += len(ended) + bool(stops)  # the tokens up to the stop, the stop included; none decoded after it
    ended_at_once += stops[:1] == [0]
    print(f"{prompt!r} -> {tokenizer.decode(ended)!r}")
  print(f"compile+run {compiled - start:.2f} s; run {elapsed:.3f} s; {counted / elapsed:,.0f} tokens/s to the stops "
        f"({counted} of {out.size} decoded; batch {len(prompts)})")
  if ended_at_once and tokenizer.chat_template and not args.chat:
    print(f"{ended_at_once} of {len(prompts)} prompts: the model ended its turn at its first token; a chat model "
          "answers a prompt put into its template: add --chat")
  return 0


def cmd_convert(args) -> int:
  from streamrl_jax.models.gguf import convert

  out = convert(args.gguf, args.out_dir)
  print(f"wrote {out} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)")
  return 0


def cmd_merge(args) -> int:
  from streamrl_jax.models.merge import merge_adapter

  out = merge_adapter(args.base, args.adapter, args.out)
  print(f"wrote {out} (the base with the adapter merged: config.json, model.safetensors, the base's tokenizer files)")
  return 0


def cmd_simulate(args) -> int:
  from streamrl_jax.sim.preset_run import run_preset, summary_lines, written

  results = run_preset(args.preset, args.out, iterations=args.iterations, seed=args.seed)
  for line in summary_lines(results):
    print(line)
  print(f"wrote {args.out}/" + ", ".join(written(args.preset)))
  return 0


def _config_args(parser) -> None:
  parser.add_argument("--config", action="append", default=[], metavar="FILE",
                      help="a gin file, or a shipped config by its short name (smollm2_cpu); repeatable, read in "
                           "order (default: configs/demo_cpu.gin, the CPU demo)")
  parser.add_argument("--set", action="append", default=[], metavar="CLASS.KEY=VALUE",
                      help="one gin binding over the files, e.g. --set PipelineConfig.steps=20; repeatable, later "
                           "ones win; `streamrl config` lists every key with its type and help")


def build_parser() -> argparse.ArgumentParser:
  from streamrl_jax.commands.compare import add_compare_parser
  from streamrl_jax.commands.launch_local import add_launch_parser
  from streamrl_jax.commands.plan import add_plan_parser
  from streamrl_jax.commands.roles import add_role_parsers
  from streamrl_jax.commands.scorer import add_scorer_parser
  from streamrl_jax.commands.serve import add_serve_parser
  from streamrl_jax.commands.train import arms_arg, cmd_train

  parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n")[0])
  parser.add_argument("--host-devices", type=int, default=None,
                      help="CPU devices to force when running on the CPU (default: one per CPU core, at least 2 so "
                           "both meshes exist, more if MeshConfig asks; for `trainer` and `sampler`: "
                           "MeshConfig.<role>_devices, else one per core; 0 leaves XLA_FLAGS alone)")
  parser.add_argument("--log-level", default="INFO", type=str.upper, choices=logs.LEVELS,
                      help="the least severe log lines shown (default INFO); a program of a run across processes "
                           "starts each line with the time, its role and its process id")
  sub = parser.add_subparsers(dest="command", required=True)
  conf = sub.add_parser("config", help="print every key of the resolved configuration, its value, type and help, "
                        "as a gin file (a valid --config)")
  _config_args(conf)
  conf.set_defaults(run=cmd_config)
  info = sub.add_parser("info", help="devices, versions and the mesh split a config would use")
  _config_args(info)
  info.set_defaults(run=cmd_info)
  tasks = sub.add_parser("tasks", help="each built-in task's example prompt, its row's fields (what a reward "
                         "function gets as keyword arguments) and the function that scores it")
  tasks.set_defaults(run=cmd_tasks)
  _model_parsers(sub)
  train = sub.add_parser("train", help="RL post-training (default: the CPU demo, async GRPO on arithmetic)",
                         description="RL post-training: a run of the configs' model on their task, its metrics, "
                                     "pictures, checkpoints and final model in --workdir. Without --config, the CPU "
                                     "demo (configs/demo_cpu.gin: a tiny decoder, 300 warm-up steps, 80 async GRPO "
                                     "steps on arithmetic). Ctrl-C stops at a step boundary; --resume continues.",
                         epilog="e.g. streamrl train --config smollm2_cpu --set PipelineConfig.steps=20 "
                                "--set OptimizerConfig.learning_rate=1e-5 --workdir runs/smollm2")
  _config_args(train)
  train.add_argument("--workdir", required=True, help="where metrics, pictures, checkpoints and models go")
  arms_arg(train)
  train.add_argument("--resume", nargs="?", const=True, default=False, choices=["auto"],
                     help="continue from the latest checkpoint in the workdir (an error when there is none); "
                          "--resume=auto: continue if there is one, else start afresh")
  train.set_defaults(run=cmd_train)
  add_role_parsers(sub, _config_args)
  add_scorer_parser(sub, _config_args)
  add_launch_parser(sub, _config_args)
  for add in (add_serve_parser, add_compare_parser, _simulate_parser):
    add(sub)
  add_plan_parser(sub, _config_args)
  return parser


def _model_parsers(sub) -> None:
  """`generate`, `convert` and `merge`: the commands on a model alone."""
  gen = sub.add_parser("generate", help="generate from prompts through the KV cache")
  gen.add_argument("--model", help="a catalog name (smollm2-135m-instruct), a .gguf file, a Hugging Face "
                   "directory or a Hub id (org/name[@revision]) (default: a tiny random demo model)")
  gen.add_argument("--chat", action="store_true", help="put each prompt into the model's chat template")
  gen.add_argument("--system", default=None, help="with --chat: the system message (default: the template's)")
  gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
  gen.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt at most (default 24)")
  gen.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (the default) decodes greedily")
  gen.add_argument("--seed", type=int, default=0, help="seed of the sampling and of the demo model's weights")
  gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' and activations' dtype (default float32)")
  gen.set_defaults(run=cmd_generate)
  conv = sub.add_parser("convert", help="a GGUF file (llama, qwen2) to a Hugging Face directory")
  conv.add_argument("gguf", help="the .gguf file")
  conv.add_argument("out_dir", help="the directory to write")
  conv.set_defaults(run=cmd_convert)
  merge = sub.add_parser("merge", help="a base model with a PEFT LoRA adapter merged in, as a Hugging Face directory")
  merge.add_argument("base", help="the base: a catalog name (smollm2-135m-instruct), a .gguf file or a Hugging Face "
                     "directory")
  merge.add_argument("adapter", help="the PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
  merge.add_argument("out", help="the directory to write")
  merge.set_defaults(run=cmd_merge)


def _simulate_parser(sub) -> None:
  from streamrl_jax.sim.preset_names import PRESETS

  sim = sub.add_parser("simulate", help="simulate the pipeline at cluster scale (results.json and plots)")
  sim.add_argument("--preset", default="paper-72b-20k", choices=PRESETS, metavar="NAME",
                   help=f"the cluster, model and lengths simulated: {', '.join(PRESETS)} (default paper-72b-20k)")
  sim.add_argument("--out", required=True, help="output directory")
  sim.add_argument("--iterations", type=int, default=3, help="RL iterations simulated per mode (default 3; "
                   "distflow-scaling is analytic and takes none)")
  sim.add_argument("--seed", type=int, default=0, help="seed of the simulated output lengths")
  sim.set_defaults(run=cmd_simulate)


def _role(args) -> str | None:
  """What a program of a run across processes calls itself on its log lines; None for a one-process command."""
  if args.command == "trainer":
    return "trainer" if args.process_id is None else f"trainer/{args.process_id}"
  if args.command == "sampler":
    return args.name if args.process_id is None else f"{args.name}/{args.process_id}"
  if args.command == "follower":
    return f"follower {Path(args.arm).stem}"
  if args.command == "scorer":
    return f"scorer {args.stage}"
  if args.command == "launch" and args.where == "local":
    return "launch"  # its lines interleave with its children's: stamped as theirs are
  return None


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def main(argv=None) -> int:
  stopping.early_interrupts()  # Ctrl-C at any moment, module loading included: one line and exit 130
  command = "command"
  try:
    limit_fragmentation()  # before the large arrays of a run exist (see host_memory)
    args = build_parser().parse_args(argv)
    command = args.command
    return _run(args)
  except KeyboardInterrupt:
    print(f"streamrl {command}: interrupted", file=sys.stderr, flush=True)
    return 130


def _run(args) -> int:
  from streamrl_jax import distributed

  try:
    if args.host_devices is None:
      from streamrl_jax.commands.plan import plan_host_devices
      from streamrl_jax.commands.roles import ROLES, role_host_devices
      args.host_devices = (role_host_devices(args) if args.command in ROLES else 0 if args.command == "launch"
                           else plan_host_devices(args) if args.command == "plan" else default_host_devices(args))
    force_host_devices(args.host_devices)
    logs.configure(args.log_level, role=_role(args), around_bar=args.command == "train")
    if args.command in ("trainer", "sampler", "follower", "scorer"):  # a launcher's SIGTERM stops them as Ctrl-C
      signal.signal(signal.SIGTERM, _interrupt)
    code = args.run(args)
  except (ValueError, OSError, KeyError) as err:  # OSError: missing files, a model that could not be fetched
    print(f"streamrl {args.command}: error: {err}", file=sys.stderr)
    code = 2
  except KeyboardInterrupt:
    if distributed.joined():  # one line, then leave without waiting for the others (see leave_on_failure)
      print(f"streamrl {args.command}: interrupted", file=sys.stderr)
      distributed.leave_on_failure(130)
    raise
  except BaseException:
    if distributed.joined():  # say why, then leave without waiting for the others (see leave_on_failure)
      import traceback
      traceback.print_exc()
      distributed.leave_on_failure(1)
    raise
  distributed.leave_on_failure(code)
  return code


if __name__ == "__main__":
  sys.exit(main())
