"""`streamrl plan`: a run planned for a topology before it is paid for. It reads the run's gin files as `streamrl
train` does, the model's shapes alone (no weight), compiles the trainer's and the sampler's programs for the topology's
chips with TPU's own compiler (the `libtpu` wheel; no TPU needed) on the meshes the run would build, and prints each
side's per-chip memory against the chip's, its roofline step time, the collectives' bytes and the simulator's
samples/s at the split; `--json` adds one object as the last line. Exit code 1 when the run does not fit (the line
before says what would), 2 on a mistake in the command or its configs."""

from __future__ import annotations

import json
import sys


def add_plan_parser(sub, common) -> None:
  plan = sub.add_parser("plan", help="compile a run's trainer and sampler for a TPU topology (or this CPU) and say "
                        "whether it fits, how fast it should go and which split to use",
                        epilog="e.g. streamrl plan --model Qwen/Qwen3-8B --topology v5p:4x4x2 --config "
                               "configs/pod_qwen3_8b.gin --json")
  common(plan)
  plan.add_argument("--model", default="", help="a config.json, a Hugging Face directory, a catalog name, a .gguf "
                    "file or a Hub id (shapes only: no weight is read; default JobConfig.model)")
  plan.add_argument("--topology", required=True, help="the chips: a TPU slice (v5e:4x4, v5p:4x4x2, v6e:16x16, ...) "
                    "or cpu:N (this machine's CPU as N devices)")
  plan.add_argument("--split", type=int, default=0, metavar="SAMPLER_CHIPS", help="chips of the sampler side (the "
                    "rest train); default: the simulator's best split that fits")
  plan.add_argument("--new-tokens", type=float, default=0.0, help="the median completion length to plan for "
                    "(default: half of PipelineConfig.max_new_tokens)")
  plan.add_argument("--efficiency", type=float, default=0.5, help="the share of its roofline each side reaches, for "
                    "the simulator's samples/s (default 0.5)")
  plan.add_argument("--check", action="store_true", help="with --topology cpu:N: then run each side as planned on "
                    "this machine's devices and print the plan's memory and step times over the measured ones")
  plan.add_argument("--json", action="store_true", help="also print the plan as one JSON object, the last line")
  plan.set_defaults(run=cmd_plan)


def plan_host_devices(args) -> int:
  """CPU devices the command forces: the topology's for cpu:N, else one (a TPU plan compiles on no CPU device)."""
  topology = args.topology.strip()
  return int(topology.split(":", 1)[1]) if topology.startswith("cpu:") and topology[4:].isdigit() else 1


def cmd_plan(args) -> int:
  from streamrl_jax.commands.plan_inputs import planned_run
  from streamrl_jax.planning.chips import parse_topology
  from streamrl_jax.planning.measured import can_measure
  from streamrl_jax.planning.plan import PlanRequest, advice, make_plan
  from streamrl_jax.planning.report import check_text, plan_json, plan_text

  platform = parse_topology(args.topology).chip.platform
  if args.check and (platform != "cpu" or can_measure()):
    why = can_measure() or "it runs each side on this machine: only with --topology cpu:N"
    raise ValueError(f"plan --check: {why}")
  setup, model, source, spec = planned_run(args.config, args.set, args.model, platform)
  request = PlanRequest(spec, args.topology, args.split, args.new_tokens, args.efficiency)
  progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
  plan = make_plan(request, setup, model, source, progress=progress)
  print(plan_text(plan), flush=True)
  check = None
  if args.check:
    from streamrl_jax.commands.plan_check import check_plan

    check = check_plan(plan, args.config, args.set, progress)
    print(check_text(check), flush=True)
  if not plan.fits:
    print(f"streamrl plan: {advice(plan)}", file=sys.stderr, flush=True)
  if args.json:
    print(json.dumps(plan_json(plan) | ({"check": check.figures()} if check else {})), flush=True)
  return 0 if plan.fits else 1
