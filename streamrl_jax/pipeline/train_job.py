"""The main job behind `streamrl train`: the supervised warm-up and the held-out evaluation (`job/`), the RL run,
and its outputs (`records/`: config.gin, metrics JSONL, TensorBoard events, learning curves and timeline PNGs, Chrome
trace, the run's record, final checkpoint, summary).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx

from streamrl_jax.arms.config import arm_advice, lead_arm
from streamrl_jax.arms.outputs import arm_outputs, describe_arm, finish_arms
from streamrl_jax.config_listing import render
from streamrl_jax.host_memory import release_free_memory
from streamrl_jax.job.config import JobConfig
from streamrl_jax.job.evaluation import HeldOut, Scores, held_out_of
from streamrl_jax.job.warmup import warm_model
from streamrl_jax.models import lora
from streamrl_jax.models.catalog import base_model_id
from streamrl_jax.pipeline import preflight
from streamrl_jax.pipeline.config import DERIVED_KEYS, PipelineConfig
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.records import run_files, run_record
from streamrl_jax.records.metrics_log import PeriodicEval, read_metrics
from streamrl_jax.records.pictures import write_run_curves, write_run_pictures
from streamrl_jax.records.step_outputs import step_outputs, wandb_run
from streamrl_jax.settings import flat_settings
from streamrl_jax.stopping import RunStopped, StopRequest
from streamrl_jax.training.checkpoint import Checkpointer

_log = logging.getLogger(__name__)

__all__ = ["JobConfig", "JobControl", "train_job"]
CONFIG_HEADER = ("The configuration this run ran with, every key with its type and help.\n"
                 "`streamrl train --config WORKDIR/config.gin --workdir NEW` runs it again.")


@dataclasses.dataclass(frozen=True)
class JobControl:
  """How the caller runs and watches a job. `runner` runs the RL steps: `run_pipeline` (one program) or the
  trainer's side of separate programs (`trainer.program.serve_training`); `role` ("train" or "trainer") says which
  meshes `preflight` checks before anything is built; `stop`: a stop request the RL steps honour at a step
  boundary; `on_start(done)` is called as the RL steps begin, with the steps already trained (a resumed run's),
  `progress(metrics)` after each."""

  runner: Callable = run_pipeline
  role: str = "train"
  stop: StopRequest | None = None
  on_start: Callable[[int], None] | None = None
  progress: Callable[[dict], None] | None = None


def train_job(config: PipelineConfig, job: JobConfig, workdir: str | Path, resume: bool | str = False,
              control: JobControl = JobControl()) -> dict:
  """Warm-up (cached), evaluation, the RL run with a checkpoint per step, evaluation, outputs.
  `resume` continues from the latest checkpoint in `workdir/checkpoints`; "auto" does when there is one
  and starts afresh when not (a restart by a cluster scheduler). In a trainer of several processes every process
  runs this; only process 0 evaluates and writes files. However the job stops early (`control.stop`,
  KeyboardInterrupt), it raises `RunStopped` naming the checkpoint on disk once the last save has committed.
  A resumed run's outputs cover the whole run (`run_record`)."""
  workdir = preflight.check_workdir(workdir)
  checkpointer = Checkpointer(workdir / "checkpoints", max_to_keep=2, every=job.checkpoint_every)
  try:
    return _job(config, job, workdir, checkpointer, resume, control)
  except (RunStopped, KeyboardInterrupt) as err:
    checkpointer.wait()  # the last save commits (a second Ctrl-C here stops at once)
    raise RunStopped(checkpointer.latest_step(),
                     err.abandoned_step if isinstance(err, RunStopped) else None) from err
  finally:
    checkpointer.close()


def _job(config: PipelineConfig, job: JobConfig, workdir: Path, checkpointer, resume: bool | str,
         control: JobControl) -> dict:
  leader = jax.process_index() == 0
  settings = flat_settings(config, job)
  resume = _resolved_resume(workdir, settings, resume, checkpointer.latest_step())
  configured = config.sampler.precision
  config, task, heldout, tokenizer = _preflight(config, job, control.role)
  workdir.mkdir(parents=True, exist_ok=True)
  if leader:
    _write_run_files(workdir, config, job, settings, configured)
  model, tokenizer = warm_model(job, task, workdir, config.sampler.engine.max_prompt_length + config.max_new_tokens,
                                leader)
  held_out = held_out_of(job, tokenizer, heldout, config.sampler, config.max_new_tokens)
  scores_before = _scores_before(model, held_out, workdir, leader, resume)
  before, resumed_at = scores_before.accuracy, checkpointer.latest_step() if resume else None
  if leader:
    _log.info(f"held-out accuracy before RL: {scores_before.line()}")
    write_run_curves(workdir, config.mode, config.steps, before)
  if resume:
    _log.info(f"resuming from the checkpoint of step {resumed_at}")
  record = run_record.RunRecord(workdir, resumed_at) if leader else None
  in_process_arms = bool(config.arms.followers) and not config.arms.programs
  if config.arms.followers and leader:  # the lead's, for `compare`
    run_files.write_arm(workdir, describe_arm(lead_arm(config.arms, config.trainer, config.shape)))
  if control.on_start is not None:
    control.on_start(resumed_at or 0)
  with wandb_run(workdir, job.report_to, settings, leader) as tracker:
    with (step_outputs(workdir, resumed_at, control.progress, record, job.report_to, tracker) if leader
          else contextlib.nullcontext()) as on_step, \
         (arm_outputs(workdir, config.arms, bool(resume)) if in_process_arms else contextlib.nullcontext()) as arms:
      try:
        hooks = RunHooks(checkpointer, resume, control.stop, on_step, record.end if leader else None,
                         donate_model=True, **_run_kwargs(config, job.eval_every, (model, held_out), workdir, arms))
        result = control.runner(config, model, tokenizer, task, hooks=hooks)
      except (RunStopped, KeyboardInterrupt):
        if leader:  # the pictures of the run so far
          write_run_pictures(workdir, config.mode, config.steps, before, record.segments)
        raise
    checkpointer.wait()
    release_free_memory()  # the run's state and weights, freed, as heap holes: given back before evaluating and saving
    if control.stop is not None and control.stop.requested:  # asked during the last step: stop before evaluating
      if leader:
        write_run_pictures(workdir, config.mode, config.steps, before, record.segments)
      raise RunStopped(checkpointer.latest_step())
    if not leader:
      return {}
    summary = _finish(config, job, model, held_out, result, workdir, before, record.segments)
    if tracker is not None:
      tracker.pictures(workdir, summary["steps"])
    return summary


def _write_run_files(workdir: Path, config: PipelineConfig, job: JobConfig, settings: dict, configured: str) -> None:
  """settings.json, with what this machine made of 'auto' and why, and config.gin, whose sampler precision stays as
  `configured` (another machine decides 'auto' for itself)."""
  choice = job.compute_choice()
  run_files.write_settings(workdir, {**settings, "resolved.compute_dtype": choice.dtype,
                                     "resolved.compute_dtype_reason": choice.reason,
                                     "resolved.SamplerConfig.precision": config.sampler.precision})
  written = dataclasses.replace(config, sampler=dataclasses.replace(config.sampler, precision=configured))
  run_files.write_config(workdir, render([written, job], DERIVED_KEYS, CONFIG_HEADER))


def _run_kwargs(config: PipelineConfig, eval_every: int, evaluated: tuple, workdir: Path, arms) -> dict:
  """The run's hooks for periodic evaluation (`evaluated`: the model and its `HeldOut`) and arms."""
  kwargs = {"periodic_eval": _periodic_eval(eval_every, *evaluated)} if eval_every else {}
  if config.arms.followers and config.arms.programs:  # the follower programs must belong to this run
    return dict(kwargs, run_id=run_record.run_id(workdir))
  return dict(kwargs, arm_outputs=arms) if arms else kwargs


def _resolved_resume(workdir: Path, settings: dict, resume: bool | str, latest: int | None) -> bool:
  """Whether this run resumes (`preflight.check_resume`); --resume=auto says which it chose."""
  resolved = preflight.check_resume(workdir, settings, resume, latest)
  if resume == "auto":
    _log.info(f"--resume=auto: {'a checkpoint is there' if resolved else 'no checkpoint yet, starting afresh'}")
  return resolved


def _periodic_eval(eval_every: int, model, held_out: HeldOut) -> PeriodicEval:
  """`JobConfig.eval_every`'s evaluation of any policy of this model (the lead's or an arm's: arms share the run's
  sampling settings)."""
  graphdef, _ = nnx.split(model)
  return PeriodicEval(eval_every, lambda params: held_out.scores(nnx.merge(graphdef, params)).metrics())


def _preflight(config: PipelineConfig, job: JobConfig, role: str):
  """Every check that needs no weights, before anything is built; returns (config, task, held-out task, tokenizer),
  the config with LoRA resolved (`preflight.check_lora`) and the sampler's precision ('auto': the compute dtype)."""
  choice = job.compute_choice()
  _log.info(f"computing in {choice.dtype}: {choice.reason}")
  config = config.resolved(choice.dtype)
  preflight.check_devices(config, role, len(jax.devices()))
  if job.eval_every and jax.process_count() > 1:
    raise ValueError("JobConfig.eval_every: periodic evaluation runs in a trainer of one process; this one has "
                     f"{jax.process_count()}")
  if advice := preflight.correction_advice(config):
    _log.warning(advice)
  for advice in arm_advice(config.arms):
    _log.warning(advice)
  if config.arms.followers and config.arms.programs and role == "train":
    raise ValueError("ArmsConfig.programs: follower programs read their streams from a trainer program's "
                     "Flight server; run `streamrl launch local --arms ...` (or `streamrl trainer` and "
                     "`streamrl follower`), or leave arm_programs off to train the arms in this program")
  model_config, tokenizer = job.model_spec()
  task, heldout = job.make_task(tokenizer), job.make_task(tokenizer, "eval")
  preflight.check_activation_budget(config, model_config)
  config = preflight.check_lora(config, model_config, job.model)
  if jax.devices()[0].platform == "cpu":  # the host holds everything: say now if it cannot
    preflight.check_host_memory(config, model_config, role, preflight.available_host_bytes())
  preflight.check_prompts(task, tokenizer, config.sampler.engine.max_prompt_length, job.seed)
  preflight.check_stops(config, tokenizer)
  preflight.check_rewards(config.sampler.reward, task, job.seed)
  return config, task, heldout, tokenizer


def _scores_before(model, held_out: HeldOut, workdir: Path, leader: bool, resume: bool) -> Scores:
  """Held-out scores before RL: measured once (a resumed run reads them back); NaN off process 0."""
  if not leader:
    return Scores(float("nan"))
  if resume and (kept := run_files.read_accuracy_before(workdir)) is not None:
    return Scores(kept, run_files.read_at_k_before(workdir))
  before = held_out.scores(model, workdir / run_files.EVAL_BEFORE)
  run_files.write_accuracy_before(workdir, before.accuracy, before.at_k)
  return before


def _finish(config: PipelineConfig, job: JobConfig, model, held_out: HeldOut, result, workdir: Path, before: float,
            segments: list[dict]) -> dict:
  """The trained model evaluated and saved, the pictures drawn, the summary of the whole run written (every
  segment of a resumed run); returns the summary."""
  graphdef, _ = nnx.split(model)
  trained = nnx.merge(graphdef, result.params)
  scores = held_out.scores(trained, workdir / run_files.EVAL_AFTER)
  after = scores.accuracy
  _log.info(f"held-out accuracy after RL: {scores.line()}, {after - before:+.3f} since before")
  adapter = None if result.adapters is None else lora.adapter_arrays(result.adapters)
  run_files.save_final(workdir, trained, adapter, config.trainer.lora, base_model_id(job.model))
  if adapter is not None:  # LoRA: the adapter alone too, in the PEFT format (`streamrl merge` rebuilds final_model)
    _log.info(f"saved the adapter to {workdir / run_files.FINAL_ADAPTER} (PEFT format) and the merged model to "
              f"{workdir / run_files.FINAL_MODEL}")
  write_run_pictures(workdir, config.mode, config.steps, before, segments, after, scores.at_k)
  whole = run_record.arm_totals(segments)  # each arm's counters over the run's segments, not this one's alone
  result = dataclasses.replace(result, arms={n: dataclasses.replace(a, counters=whole.get(n, a.counters))
                                             for n, a in result.arms.items()})
  arms = finish_arms(result, model, config.arms, config.steps, workdir, before, held_out)
  by_arm = {"arm": config.arms.lead_name, "arms": {n: a["accuracy_after"] for n, a in arms.items()}} if arms else {}
  at_k = {**{f"{k}_before": v for k, v in run_files.read_at_k_before(workdir).items()}, **scores.at_k}
  summary = dict(accuracy_before=before, accuracy_after=after, **at_k, **run_record.totals(segments),
                 steps=len(read_metrics(workdir)), **by_arm)
  run_files.write_summary(workdir, summary)
  return summary
