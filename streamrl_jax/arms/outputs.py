"""Each follower arm's outputs, under WORKDIR/arms/NAME: its checkpoints, metrics.jsonl (every row with `arm`),
arm.json (what it trains with), and after the run its held-out evaluation (eval_after.jsonl), final_model,
curves.png and summary.json. The lead's are the run's own, in WORKDIR. `streamrl compare` reads both."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

from flax import nnx

from streamrl_jax.models import save_hf
from streamrl_jax.arms.config import arm_pipeline
from streamrl_jax.records.metrics_log import evaluations, open_metrics, read_metrics
from streamrl_jax.records.pictures import write_curves_png
from streamrl_jax.records.run_record import ARMS_DIR

_log = logging.getLogger(__name__)


def arm_dir(workdir: Path, name: str) -> Path:
  return Path(workdir) / ARMS_DIR / name


def describe_arm(config) -> dict:
  """What an arm trains with, as arm.json and the comparison's table show it."""
  return dict(arm=config.arms.lead_name, advantage=config.advantage, objective=config.trainer.objective.objective,
              learning_rate=config.trainer.optimizer.learning_rate, aggregation=config.trainer.objective.aggregation,
              seed=config.seed)


@contextlib.contextmanager
def arm_outputs(workdir: Path, config, resume: bool):
  """{arm name: (checkpointer, on_step)} for every follower arm; on_step appends its rows to its metrics.jsonl. A
  resumed arm's rows after its own checkpoint are dropped first (they are trained again). Checkpoints are waited
  for and closed on the way out."""
  from streamrl_jax.training.checkpoint import Checkpointer

  outputs, files = {}, []
  try:
    for arm in config.arms.followers:
      directory = arm_dir(workdir, arm.name)
      directory.mkdir(parents=True, exist_ok=True)
      checkpointer = Checkpointer(directory / "checkpoints", max_to_keep=2)
      latest = checkpointer.latest_step()
      if latest is not None and not resume:
        checkpointer.close()
        raise ValueError(f"arm {arm.name!r}: {directory / 'checkpoints'} holds checkpoints up to step {latest}; "
                         "continue them with --resume or start afresh in another --workdir")
      (directory / "arm.json").write_text(json.dumps(describe_arm(arm_pipeline(config, arm)), indent=1))
      out = open_metrics(directory, latest if resume else None)
      files.append(out)
      outputs[arm.name] = (checkpointer, _appender(out))
    yield outputs
  finally:
    for out in files:
      out.close()
    for checkpointer, _ in outputs.values():
      checkpointer.wait()
      checkpointer.close()


def _appender(out):
  def on_step(row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()
  return on_step


@dataclasses.dataclass(frozen=True)
class HeldOut:
  """The lead's held-out evaluation, as an arm's end applies it: `evaluate(model, tokenizer, task, config, prompts,
  seed, record)` (the job's greedy accuracy) on `prompts` prompts of the held-out `task`, drawn with `seed`."""

  tokenizer: object
  task: object
  prompts: int
  seed: int
  evaluate: Callable

  def accuracy(self, model, config, record: Path) -> float:
    return self.evaluate(model, self.tokenizer, self.task, config, self.prompts, self.seed, record)


def finish_arms(result, model, config, workdir: Path, before: float, held_out: HeldOut) -> dict:
  """Each follower's trained policy evaluated on the held-out prompts and saved; its curves and summary.json
  written. Returns {arm name: summary}."""
  graphdef, _ = nnx.split(model)
  arms, summaries = {arm.name: arm for arm in config.arms.followers}, {}
  for name, arm in result.arms.items():
    if arm.params is None:
      _log.warning(f"arm {name!r} failed during the run: not evaluated; `--resume` continues it from "
                   f"{arm_dir(workdir, name) / 'checkpoints'}")
      continue
    summaries[name] = finish_arm(arm_dir(workdir, name), arm_pipeline(config, arms[name]),
                                 nnx.merge(graphdef, arm.params), arm.counters, before, held_out)
  return summaries


def finish_arm(directory: Path, config, trained, counters: dict, before: float | None, held_out: HeldOut) -> dict:
  """One follower's end: its trained model evaluated and saved to DIRECTORY/final_model, its curves drawn and its
  summary.json written (`before`: the held-out accuracy of the policy every arm started from, None if unknown)."""
  name = config.arms.lead_name
  after = held_out.accuracy(trained, config, directory / "eval_after.jsonl")
  change = f" ({after - before:+.3f})" if before is not None else ""
  _log.info(f"arm {name!r}: held-out accuracy after RL {after:.3f}{change}; "
            f"{counters.get('arm_steps_skipped', 0)} steps skipped")
  save_hf(trained, directory / "final_model")
  rows = read_metrics(directory)
  write_curves_png(rows, evaluations(rows, before, after, config.steps), directory / "curves.png",
                   title=f"arm {name}: {config.advantage}, {config.trainer.objective.objective}")
  summary = dict(describe_arm(config), accuracy_before=before, accuracy_after=after, steps=len(rows),
                 counters={k: v for k, v in counters.items() if not isinstance(v, (list, dict))})
  (directory / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary
