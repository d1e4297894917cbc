"""The main job behind `streamrl train`: optional supervised warm-up, held-out evaluation, the RL run,
and its outputs (config.gin, metrics JSONL, TensorBoard events, learning curves and timeline PNGs, Chrome trace,
the run's record, final checkpoint, summary).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from streamrl_jax.agents.evaluation import agent_completions
from streamrl_jax.config_listing import render
from streamrl_jax.host_memory import release_free_memory
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import load_hf, lora, save_hf
from streamrl_jax.models.catalog import base_model_id
from streamrl_jax.models.peft_io import save_adapter
from streamrl_jax.pipeline import preflight
from streamrl_jax.records import run_record
from streamrl_jax.arms.outputs import HeldOut, arm_outputs, describe_arm, finish_arms
from streamrl_jax.arms.config import arm_advice, lead_arm
from streamrl_jax.pipeline.config import DERIVED_KEYS, PipelineConfig
from streamrl_jax.pipeline.job_config import JobConfig
from streamrl_jax.records.metrics_log import (PeriodicEval, WandbRun, add_row, append_row, evaluations, open_metrics,
                                              read_metrics, tensorboard_writer)
from streamrl_jax.records.pictures import write_chrome_trace, write_curves_png, write_timeline_png
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.sampling import StreamingSampler, make_engine
from streamrl_jax.settings import flat_settings
from streamrl_jax.stopping import RunStopped, StopRequest
from streamrl_jax.envs import make_tools
from streamrl_jax.rewards import RewardScorer
from streamrl_jax.tasks import prompt_tokens, question, verifier
from streamrl_jax.tasks.heldout import accuracy, evaluation_where, heldout_prompts
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Trainer
from streamrl_jax.training.checkpoint import Checkpointer
from streamrl_jax.types import SamplingParams

_log = logging.getLogger(__name__)

__all__ = ["JobConfig", "evaluate", "greedy_completions", "read_metrics", "supervised_warmup", "train_job"]
CONFIG_FILE = "config.gin"
CONFIG_HEADER = ("The configuration this run ran with, every key with its type and help.\n"
                 "`streamrl train --config WORKDIR/config.gin --workdir NEW` runs it again.")


def supervised_warmup(model, tokenizer, task, job: JobConfig, width: int):
  """Teacher-forced cross-entropy on (prompt, worked solution) pairs through the RL trainer with the
  `reinforce` objective and advantage 1: its loss is then the completion tokens' mean NLL."""
  graphdef, params = nnx.split(model)
  mesh = single_device_mesh()
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=job.warmup_learning_rate, warmup_steps=20),
                    ObjectiveConfig(objective="reinforce", correction="none"), mesh)
  state = trainer.init_state(params, seed=job.seed)
  rng = np.random.default_rng(job.seed + 1)
  for step in range(job.warmup_steps):
    batch = _teacher_batch(tokenizer, task, [task.sample(rng) for _ in range(job.warmup_batch)], width)
    state, metrics = trainer.apply(trainer.accumulate(state, batch))
    if step % 100 == 0 or step == job.warmup_steps - 1:
      _log.info(f"warm-up step {step + 1}/{job.warmup_steps}: nll {metrics['loss']:.3f}")
  return nnx.merge(graphdef, jax.device_get(state.params))


def _teacher_batch(tokenizer, task, pairs, width: int) -> dict:
  tokens = np.zeros((len(pairs), width), np.int32)
  valid = np.zeros((len(pairs), width), bool)
  for row, (prompt, solution) in enumerate(pairs):
    ids = prompt_tokens(task, tokenizer, prompt) + tokenizer.encode(solution) + [tokenizer.eos_id]
    tokens[row, :len(ids)], valid[row, :len(ids)] = ids[:width], True
  prompt_len = np.array([len(prompt_tokens(task, tokenizer, p)) for p, _ in pairs])[:, None]
  loss_mask = valid & (np.arange(width)[None] >= prompt_len)
  return dict(tokens=tokens, valid=valid, loss_mask=loss_mask, advantages=np.ones(len(pairs), np.float32),
              logprobs=np.zeros((len(pairs), width), np.float32))


def evaluate(model, tokenizer, task, config: PipelineConfig, prompts: int, seed: int,
             record: Path | None = None) -> float:
  """Greedy accuracy on held-out prompts (their own seed, never used for training); with `record`, every
  (prompt, completion, reward) is written there as JSON lines."""
  if config.sampler.env.agent:  # each prompt one episode of the agent program, the policy served greedily
    rows = agent_completions(model, tokenizer, task, config.sampler, config.max_new_tokens, prompts, seed)
  else:
    rows = greedy_completions(model, tokenizer, task, config, prompts, seed)
  if record is not None:
    record.write_text("".join(json.dumps(dict(prompt=p, completion=c, reward=r)) + "\n" for p, c, r in rows))
  return accuracy([r for _, _, r in rows])


def greedy_completions(model, tokenizer, task, config: PipelineConfig, prompts: int, seed: int) -> list:
  """(prompt, completion text, reward) of greedy decoding on `prompts` prompts drawn with their own seed, scored
  by the run's rewards (`PipelineConfig.reward`)."""
  graphdef, params = nnx.split(model)
  mesh = single_device_mesh()
  engine = make_engine(graphdef, model.config, config.sampler.engine, mesh)
  tools = make_tools(config.sampler.env, tokenizer)
  sampler = StreamingSampler([engine], params, tools=tools)
  items = heldout_prompts(task, prompts, seed)
  knobs = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens, stop_token_ids=tokenizer.stop_ids)
  ids = {sampler.submit(prompt_tokens(task, tokenizer, p), knobs)[0]: (p, row) for p, row in items}
  out = {}
  with RewardScorer(config.sampler.reward, builtin=verifier(task)) as scorer:
    for sample in sampler.stream():
      (prompt, row), text = ids[sample.request_id], tokenizer.decode(sample.tokens)
      scorer.submit(sample.request_id, question(task, prompt), text, row.fields, evaluation_where(prompt, row))
      out[sample.request_id] = (prompt, text, sample.env_reward)
    while scorer.pending:
      scorer.wait(1.0)
      for request_id, score in scorer.done():
        prompt, text, env_reward = out[request_id]
        out[request_id] = (prompt, text, score.total + env_reward)
  if tools is not None:
    tools.close()
  return [out[i] for i in sorted(out)]


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
  model, tokenizer = _warm_model(config, job, task, workdir, leader)
  before = _accuracy_before(model, tokenizer, heldout, config, job, workdir, leader, resume)
  resumed_at = checkpointer.latest_step() if resume else None
  if leader:
    _log.info(f"held-out accuracy before RL: {before:.3f}")
    write_curves(workdir, config, before)
  if resume:
    _log.info(f"resuming from the checkpoint of step {resumed_at}")
  record = run_record.RunRecord(workdir, resumed_at) if leader else None
  in_process_arms = bool(config.arms.followers) and not config.arms.programs
  if config.arms.followers and leader:
    lead = lead_arm(config.arms, config.trainer, config.shape)
    (workdir / "arm.json").write_text(json.dumps(describe_arm(lead), indent=1))  # the lead's, for `compare`
  if control.on_start is not None:
    control.on_start(resumed_at or 0)
  with _wandb_run(workdir, job, settings, leader) as wandb_run:
    with (_step_outputs(workdir, resumed_at, control.progress, record, job.report_to, wandb_run) if leader
          else contextlib.nullcontext()) as on_step, \
         (arm_outputs(workdir, config.arms, bool(resume)) if in_process_arms else contextlib.nullcontext()) as arms:
      try:
        hooks = RunHooks(checkpointer, resume, control.stop, on_step, record.end if leader else None,
                         donate_model=True, **_run_kwargs(config, job, (model, tokenizer, heldout), workdir, arms))
        result = control.runner(config, model, tokenizer, task, hooks=hooks)
      except (RunStopped, KeyboardInterrupt):
        if leader:  # the pictures of the run so far
          write_pictures(workdir, config, before, record.segments)
        raise
    checkpointer.wait()
    release_free_memory()  # the run's state and weights, freed, as heap holes: given back before evaluating and saving
    if control.stop is not None and control.stop.requested:  # asked during the last step: stop before evaluating
      if leader:
        write_pictures(workdir, config, before, record.segments)
      raise RunStopped(checkpointer.latest_step())
    if not leader:
      return {}
    held_out = HeldOut(tokenizer, heldout, job.eval_prompts, job.seed, functools.partial(evaluate, config=config))
    summary = _finish(config, job, model, held_out, result, workdir, before, record.segments)
    if wandb_run is not None:
      wandb_run.pictures(workdir, summary["steps"])
    return summary


def _write_run_files(workdir: Path, config: PipelineConfig, job: JobConfig, settings: dict, configured: str) -> None:
  """settings.json, with what this machine made of 'auto' and why, and config.gin, whose sampler precision stays as
  `configured` (another machine decides 'auto' for itself)."""
  choice = job.compute_choice()
  preflight.write_settings(workdir, {**settings, "resolved.compute_dtype": choice.dtype,
                                     "resolved.compute_dtype_reason": choice.reason,
                                     "resolved.SamplerConfig.precision": config.sampler.precision})
  written = dataclasses.replace(config, sampler=dataclasses.replace(config.sampler, precision=configured))
  (workdir / CONFIG_FILE).write_text(render([written, job], DERIVED_KEYS, CONFIG_HEADER))


def _run_kwargs(config: PipelineConfig, job: JobConfig, evaluated: tuple, workdir: Path, arms) -> dict:
  """The run's hooks for periodic evaluation (`evaluated`: model, tokenizer, held-out task) and arms."""
  kwargs = {"periodic_eval": _periodic_eval(config, *evaluated, job)} if job.eval_every else {}
  if config.arms.followers and config.arms.programs:  # the follower programs must belong to this run
    return dict(kwargs, run_id=run_record.run_id(workdir))
  return dict(kwargs, arm_outputs=arms) if arms else kwargs


def _resolved_resume(workdir: Path, settings: dict, resume: bool | str, latest: int | None) -> bool:
  """Whether this run resumes (`preflight.check_resume`); --resume=auto says which it chose."""
  resolved = preflight.check_resume(workdir, settings, resume, latest)
  if resume == "auto":
    _log.info(f"--resume=auto: {'a checkpoint is there' if resolved else 'no checkpoint yet, starting afresh'}")
  return resolved


def _periodic_eval(config: PipelineConfig, model, tokenizer, heldout, job: JobConfig) -> PeriodicEval:
  """`JobConfig.eval_every`'s evaluation: greedy accuracy on the held-out prompts of any policy of this model (the
  lead's or an arm's: arms share `config`'s sampling settings)."""
  graphdef, _ = nnx.split(model)

  def held_out_accuracy(params) -> float:
    return evaluate(nnx.merge(graphdef, params), tokenizer, heldout, config, job.eval_prompts, job.seed)
  return PeriodicEval(job.eval_every, held_out_accuracy)


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


def _warm_model(config: PipelineConfig, job: JobConfig, task, workdir: Path, leader: bool):
  """(model, tokenizer): the job's model, after its supervised warm-up (loaded from the workdir once done)."""
  model, tokenizer, warm_up = job.load_model()
  warm = workdir / "warmup_model"
  if warm_up and (warm / "config.json").exists():
    model = load_hf(warm, compute_dtype=job.dtype())
    _log.info(f"loaded the warm-up model from {warm}")
  elif warm_up:
    model = supervised_warmup(model, tokenizer, task, job,
                              config.sampler.engine.max_prompt_length + config.max_new_tokens)
    if leader:
      save_hf(model, warm)
  return model, tokenizer


def _accuracy_before(model, tokenizer, heldout, config: PipelineConfig, job: JobConfig, workdir: Path, leader: bool,
                     resume) -> float:
  """Held-out accuracy before RL: measured once (a resumed run reads it back); NaN off process 0."""
  before_file = workdir / "accuracy_before.json"
  if not leader:
    return float("nan")
  if resume and before_file.exists():
    return json.loads(before_file.read_text())["accuracy"]
  before = evaluate(model, tokenizer, heldout, config, job.eval_prompts, job.seed, workdir / "eval_before.jsonl")
  before_file.write_text(json.dumps({"accuracy": before}))
  return before


def _finish(config: PipelineConfig, job: JobConfig, model, held_out: HeldOut, result, workdir: Path, before: float,
            segments: list[dict]) -> dict:
  """The trained model evaluated and saved, the pictures drawn, the summary of the whole run written (every
  segment of a resumed run); returns the summary."""
  graphdef, _ = nnx.split(model)
  trained = nnx.merge(graphdef, result.params)
  after = held_out.accuracy(trained, workdir / "eval_after.jsonl")
  _log.info(f"held-out accuracy after RL: {after:.3f} ({after - before:+.3f})")
  save_hf(trained, workdir / "final_model")
  if result.adapters is not None:  # LoRA: the adapter alone too, in the PEFT format (`streamrl merge` rebuilds final_model)
    save_adapter(workdir / "final_adapter", lora.adapter_arrays(result.adapters), config.trainer.lora,
                 base_model_id(job.model))
    _log.info(f"saved the adapter to {workdir / 'final_adapter'} (PEFT format) and the merged model to "
              f"{workdir / 'final_model'}")
  write_pictures(workdir, config, before, segments, after)
  whole = run_record.arm_totals(segments)  # each arm's counters over the run's segments, not this one's alone
  result = dataclasses.replace(result, arms={n: dataclasses.replace(a, counters=whole.get(n, a.counters))
                                             for n, a in result.arms.items()})
  arms = finish_arms(result, model, config.arms, config.steps, workdir, before, held_out)
  by_arm = {"arm": config.arms.lead_name, "arms": {n: a["accuracy_after"] for n, a in arms.items()}} if arms else {}
  summary = dict(accuracy_before=before, accuracy_after=after, **run_record.totals(segments),
                 steps=len(read_metrics(workdir)), **by_arm)
  (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary


def write_curves(workdir: Path, config: PipelineConfig, before: float, after: float | None = None) -> None:
  """WORKDIR/curves.png from metrics.jsonl and the held-out evaluations (before RL at step 0, every
  `JobConfig.eval_every` steps, after at the end)."""
  metrics = read_metrics(workdir)
  write_curves_png(metrics, evaluations(metrics, before, after, config.steps), workdir / "curves.png",
                   title=f"mode {config.mode}, {config.steps} steps")


def write_pictures(workdir: Path, config: PipelineConfig, before: float, segments: list[dict],
                   after: float | None = None) -> None:
  """curves.png, timeline.png and trace.json of the run so far, every segment of it."""
  write_curves(workdir, config, before, after)
  timeline = run_record.whole_timeline(segments)
  write_timeline_png(timeline, workdir / "timeline.png", title=f"mode {config.mode}")
  write_chrome_trace(timeline, workdir / "trace.json")


@contextlib.contextmanager
def _wandb_run(workdir: Path, job: JobConfig, settings: dict, leader: bool):
  """The run's W&B run where `JobConfig.report_to` asks (process 0), else None; finished as failed when the job
  raises."""
  run = WandbRun(workdir, run_record.run_id(workdir), settings) if leader and "wandb" in job.report_to else None
  try:
    yield run
  except BaseException:
    if run is not None:
      run.close(failed=True)
      run = None
    raise
  finally:
    if run is not None:
      run.close()


@contextlib.contextmanager
def _step_outputs(workdir: Path, resumed_at: int | None, progress, record: run_record.RunRecord,
                  report_to: tuple[str, ...], wandb_run: WandbRun | None):
  """An on_step callback that appends to metrics.jsonl, TensorBoard and W&B (as `report_to` says), keeps the run's
  record and updates the progress bar. On a resume from the checkpoint after step `resumed_at`, metrics of later
  steps (written before a crash, and about to be trained again) are dropped first, from metrics.jsonl and
  TensorBoard, so each step appears once."""
  with open_metrics(workdir, resumed_at) as out:
    writer = tensorboard_writer(workdir, read_metrics(workdir)) if "tensorboard" in report_to else None

    def on_step(m):
      append_row(out, m)
      if writer is not None:
        add_row(writer, m)
      if wandb_run is not None:
        wandb_run.add(m)
      record.step(m["step"])
      if progress is not None:
        progress(m)
    try:
      yield on_step
    finally:
      if writer is not None:
        writer.close()
