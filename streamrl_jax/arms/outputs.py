"""Each follower arm's outputs, under WORKDIR/arms/NAME: its checkpoints, metrics.jsonl (every row with `arm`),
arm.json (what it trains with), and after the run its held-out evaluation (eval_after.jsonl), final_model,
curves.png and summary.json. The lead's are the run's own, in WORKDIR. `streamrl compare` reads both."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

from flax import nnx

from streamrl_jax.arms.config import ArmConfig, ArmsConfig
from streamrl_jax.job.evaluation import HeldOut
from streamrl_jax.records.metrics_log import append_row, evaluations, open_metrics, sampled_evaluations, read_metrics
from streamrl_jax.records.pictures import write_curves_png
from streamrl_jax.records.run_files import EVAL_AFTER, save_final, write_arm, write_summary
from streamrl_jax.records.run_record import ARMS_DIR
from streamrl_jax.training.checkpoint import Checkpointer

_log = logging.getLogger(__name__)


def arm_dir(workdir: Path, name: str) -> Path:
  return Path(workdir) / ARMS_DIR / name


def describe_arm(arm: ArmConfig) -> dict:
  """What an arm trains with, as arm.json and the comparison's table show it."""
  return dict(arm=arm.name, advantage=arm.advantage, objective=arm.objective.objective,
              learning_rate=arm.optimizer.learning_rate, aggregation=arm.objective.aggregation, seed=arm.seed)


@contextlib.contextmanager
def arm_outputs(workdir: Path, arms: ArmsConfig, resume: bool):
  """{arm name: (checkpointer, on_step)} for every follower of `arms`; on_step appends its rows to its metrics.jsonl. A
  resumed arm's rows after its own checkpoint are dropped first (they are trained again). Checkpoints are waited
  for and closed on the way out."""
  outputs, files = {}, []
  try:
    for arm in arms.followers:
      directory = arm_dir(workdir, arm.name)
      directory.mkdir(parents=True, exist_ok=True)
      checkpointer = Checkpointer(directory / "checkpoints", max_to_keep=2)
      latest = checkpointer.latest_step()
      if latest is not None and not resume:
        checkpointer.close()
        raise ValueError(f"arm {arm.name!r}: {directory / 'checkpoints'} holds checkpoints up to step {latest}; "
                         "continue them with --resume or start afresh in another --workdir")
      write_arm(directory, describe_arm(arm))
      out = open_metrics(directory, latest if resume else None)
      files.append(out)
      outputs[arm.name] = (checkpointer, functools.partial(append_row, out))
    yield outputs
  finally:
    for out in files:
      out.close()
    for checkpointer, _ in outputs.values():
      checkpointer.wait()
      checkpointer.close()


def finish_arms(result, model, arms: ArmsConfig, steps: int, workdir: Path, before: float, held_out: HeldOut) -> dict:
  """Each follower's (of `arms`, in a run of `steps`) trained policy evaluated on the held-out prompts and saved; its
  curves and summary.json written. Returns {arm name: summary}."""
  graphdef, _ = nnx.split(model)
  by_name, summaries = {arm.name: arm for arm in arms.followers}, {}
  for name, arm in result.arms.items():
    if arm.params is None:
      _log.warning(f"arm {name!r} failed during the run: not evaluated; `--resume` continues it from "
                   f"{arm_dir(workdir, name) / 'checkpoints'}")
      continue
    summaries[name] = finish_arm(arm_dir(workdir, name), by_name[name], steps, nnx.merge(graphdef, arm.params),
                                 arm.counters, before, held_out)
  return summaries


def finish_arm(directory: Path, arm: ArmConfig, steps: int, trained, counters: dict, before: float | None,
               held_out: HeldOut) -> dict:
  """Follower `arm`'s end (a run of `steps`): its trained model evaluated and saved to DIRECTORY/final_model, its
  curves drawn and its summary.json written (`before`: the held-out accuracy of the policy every arm started from,
  None if unknown)."""
  name = arm.name
  scores = held_out.scores(trained, directory / EVAL_AFTER)
  after = scores.accuracy
  change = f", {after - before:+.3f} since before" if before is not None else ""
  _log.info(f"arm {name!r}: held-out accuracy after RL {scores.line()}{change}; "
            f"{counters.get('arm_steps_skipped', 0)} steps skipped")
  save_final(directory, trained)
  rows = read_metrics(directory)
  write_curves_png(rows, evaluations(rows, before, after, steps), directory / "curves.png",
                   title=f"arm {name}: {arm.advantage}, {arm.objective.objective}",
                   sampled=sampled_evaluations(rows, {}, scores.at_k, steps))
  summary = dict(describe_arm(arm), accuracy_before=before, accuracy_after=after, **scores.at_k, steps=len(rows),
                 counters={k: v for k, v in counters.items() if not isinstance(v, (list, dict))})
  write_summary(directory, summary)
  return summary
