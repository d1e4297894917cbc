"""`streamrl train`, and what it shares with `streamrl trainer`: the training job with a progress bar, a clean
Ctrl-C and the summary line.

The first Ctrl-C or SIGTERM asks the trainer to stop after the step in progress (its metrics row and checkpoint);
the second stops at once. Either way the exit code is 130 and the last line says which step is checkpointed.
"""

from __future__ import annotations

import json
import sys


def arms_arg(parser) -> None:
  """`--arms FILE ...`: follower arms (`pipeline.arms`)."""
  parser.add_argument("--arms", nargs="+", default=[], metavar="FILE",
                      help="follower arm gin files (e.g. configs/arms/*.gin): more trainers on this run's samples, "
                           "each with the advantage, objective and optimizer its file sets; the run's config leads")


def cmd_train(args) -> int:
  from streamrl_jax import gin_config
  from streamrl_jax.pipeline.runner import run_pipeline

  files = gin_config.run_files(args.config)
  gin_config.parse(files, args.set)
  config, job = gin_config.build_run()
  config = gin_config.with_arms(config, job, args.arms, files, args.set)
  return run_training(args, config, job, run_pipeline, "streamrl train")


def run_training(args, config, job, runner, prog: str) -> int:
  """`train_job` with a progress bar (process 0 of the trainer only, from the first RL step on: a resumed run's
  starts at the steps already trained), a clean Ctrl-C and the summary line."""
  import jax
  from tqdm import tqdm

  from streamrl_jax.pipeline.train_job import train_job
  from streamrl_jax.stopping import RunStopped, StopRequest

  leader = jax.process_index() == 0
  print(f"{prog}: mode {config.mode}, {config.steps} steps x {config.samples_per_step} samples, "
        f"workdir {args.workdir}", flush=True)
  bars = []

  def on_start(done: int) -> None:
    bars.append(tqdm(total=config.steps, initial=done, unit="step", dynamic_ncols=True, disable=not leader))

  def progress(m):
    bar = bars[-1]
    bar.update(1)
    extra = {"instances": m["sampler_instances"]} if "sampler_instances" in m else {}
    if "ranker_recall_top20" in m:
      extra["ranker_r20"] = f"{m['ranker_recall_top20']:.2f}"
    bar.set_postfix(reward=f"{m['reward_mean']:.3f}", acc=f"{m['accuracy']:.2f}",
                    samples_s=f"{m['samples_per_s']:.1f}", stale=f"{m['staleness_mean']:.2f}", **extra)
  stop = StopRequest(log=tqdm.write)
  resume = "auto" if getattr(args, "auto_resume", False) else args.resume
  try:
    with stop.installed():
      summary = train_job(config, job, args.workdir, log=tqdm.write, progress=progress, resume=resume,
                          runner=runner, role="trainer" if args.command == "trainer" else "train", stop=stop,
                          on_start=on_start)
  except RunStopped as stopped:
    for bar in bars:
      bar.close()
    print(f"{prog}: {stopped_advice(stopped, args.workdir)}", file=sys.stderr, flush=True)
    return 130
  finally:
    for bar in bars:
      bar.close()
  if leader:
    print(json.dumps({k: v for k, v in summary.items() if k != "counters"}))
  return 0


def stopped_advice(stopped, workdir) -> str:
  """What a stopped run left and how to go on, as it is on disk."""
  said = "stopped"
  if stopped.abandoned_step is not None:
    said += (f"; step {stopped.abandoned_step} was still waiting for samples PipelineConfig.stop_grace_s after the "
             "stop request and was abandoned")
  if stopped.saved_step is None:
    return f"{said}; no step was checkpointed, so there is nothing to resume: run the same command again"
  return (f"{said}; the checkpoint of step {stopped.saved_step} is in {workdir}/checkpoints. Continue with the same "
          "command and --resume")
