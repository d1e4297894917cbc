"""`streamrl train`, and what it shares with `streamrl trainer`: the training job with a progress bar, a clean
Ctrl-C and the summary line.

The first Ctrl-C or SIGTERM asks the trainer to stop after the step in progress (its metrics row and checkpoint);
the second stops at once. Either way the exit code is 130 and the last line says which step is checkpointed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from streamrl_jax import logs

if TYPE_CHECKING:  # the command imports jax (through the config) only when it runs
  from streamrl_jax.pipeline.config import PipelineConfig


def arms_arg(parser) -> None:
  """`--arms FILE ...`: follower arms (`arms/`)."""
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


def run_training(args, config: PipelineConfig, job, runner, prog: str) -> int:
  """`train_with_progress` with the run's first line, a stopped run's advice (exit 130) and the summary line."""
  import jax

  from streamrl_jax.stopping import RunStopped

  print(f"{prog}: mode {config.mode}, {config.steps} steps x {config.samples_per_step} samples, "
        f"workdir {args.workdir}", flush=True)
  resume = "auto" if getattr(args, "auto_resume", False) else args.resume
  try:
    summary = train_with_progress(config, job, args.workdir, runner, resume=resume,
                                  role="trainer" if args.command == "trainer" else "train")
  except RunStopped as stopped:
    print(f"{prog}: {stopped_advice(stopped, args.workdir)}", file=sys.stderr, flush=True)
    return 130
  if jax.process_index() == 0:
    print(json.dumps({k: v for k, v in summary.items() if k != "counters"}))
  return 0


def train_with_progress(config: PipelineConfig, job, workdir, runner, *, resume: bool | str = False,
                        role: str = "train") -> dict:
  """`train_job` with a progress bar (process 0 of the trainer only, from the first RL step on: a resumed run's
  starts at the steps already trained; closed once the last step is trained, before the result lines) and Ctrl-C
  or SIGTERM as a stop request (`RunStopped`, after the step in progress); returns the run's summary."""
  import jax
  from tqdm.auto import tqdm

  from streamrl_jax.pipeline.train_job import JobControl, train_job
  from streamrl_jax.stopping import StopRequest

  leader = jax.process_index() == 0
  bars = []

  def on_start(done: int) -> None:
    bars.append(tqdm(total=config.steps, initial=done, unit="step", dynamic_ncols=True, disable=not leader))

  def progress(m):
    bar = bars[-1]
    bar.update(1)
    extra = {"instances": m["sampler_instances"]} if "sampler_instances" in m else {}
    if "ranker_recall_top20" in m:
      extra["ranker_r20"] = f"{m['ranker_recall_top20']:.2f}"
    bar.set_postfix(reward=f"{m['reward_mean']:.3f}", train_acc=f"{m['accuracy']:.2f}",
                    samples_s=f"{m['samples_per_s']:.1f}", stale=f"{m['staleness_mean']:.2f}", **extra)
    if bar.n >= bar.total:  # the evaluation's and the summary's lines come after it, not under a redrawn bar
      bar.close()
  stop = StopRequest()
  try:
    with stop.installed():
      return train_job(config, job, workdir, resume=resume,
                       control=JobControl(runner, role, stop, on_start=on_start, progress=progress))
  finally:
    for bar in bars:
      bar.close()


def train(config_files=(), settings=(), workdir="runs/train", *, resume: bool | str = False, arms=()) -> dict:
  """`streamrl train` from Python (a notebook, a script): gin `config_files` (none: the CPU demo's), `settings` as
  `--set` takes them ("PipelineConfig.steps=4"), follower `arms` files; returns the run's summary (summary.json's).
  Where jax has not started yet, the CPU gets the devices `streamrl train` would give it; raises `RunStopped` when
  Ctrl-C stops the run (its checkpoint kept: call again with `resume=True`)."""
  from streamrl_jax import gin_config
  from streamrl_jax.commands.host_devices import default_host_devices, force_host_devices
  from streamrl_jax.pipeline.runner import run_pipeline

  if not logging.getLogger(logs.ROOT).handlers:  # the run's lines, as `streamrl train` shows them (unless set up)
    logs.configure(around_bar=True)
  config_files, settings = [str(f) for f in _listed(config_files)], list(_listed(settings))
  if not _jax_started():
    force_host_devices(default_host_devices(argparse.Namespace(command="train", config=config_files, set=settings)))
  files = gin_config.run_files(config_files)
  gin_config.parse(files, settings)
  config, job = gin_config.build_run()
  config = gin_config.with_arms(config, job, list(_listed(arms)), files, settings)
  return train_with_progress(config, job, workdir, run_pipeline, resume=resume)


def _listed(value) -> tuple:
  return (value,) if isinstance(value, (str, os.PathLike)) else tuple(value)


def _jax_started() -> bool:
  """Whether jax's backends exist (then XLA_FLAGS is read already)."""
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):  # a jax that moved it: leave its devices as they are
    return True


def stopped_advice(stopped, workdir) -> str:
  """What a stopped run left and how to go on, as it is on disk."""
  said = "stopped"
  if stopped.abandoned_step is not None:
    said += (f"; step {stopped.abandoned_step} was still waiting for samples WaitConfig.stop_grace_s after the "
             "stop request and was abandoned")
  if stopped.saved_step is None:
    return f"{said}; no step was checkpointed, so there is nothing to resume: run the same command again"
  return (f"{said}; the checkpoint of step {stopped.saved_step} is in {workdir}/checkpoints. Continue with the same "
          "command and --resume")
