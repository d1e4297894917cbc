"""Several trainers on one sample stream (issue 40): what generation costs each arm, what followers cost the
lead, and whether a follower of the lead's algorithm learns as the lead does.

On the CPU demo (the tiny decoder after a shared supervised warm-up; `stream` mode; the demo's batch of 16 prompts
x 8 samples), two runs of `train_job` with equal steps, one after the other:

- `alone`: the lead only.
- `arms`: the lead (GRPO, `ppo`) and two followers on devices of their own: `grpo` (the lead's estimator and
  learning rate, with the follower's correction `token_tis`) and `rloo` (`configs/arms/rloo.gin`).

Figures:
- `samples_generated_per_arm_step`: samples the samplers generated per arm-step trained (every arm's steps
  counted) with three arms, over the same with one. Generation is shared when it is 1/3 (goal <= 0.4).
- `lead_step_ratio`: the lead's steady step (median `step_s` after the first two, which compile) with the two
  followers, over alone (goal <= 1.15). Here all "devices" are threads on the same 2 cores: a follower's
  training takes CPU from the sampler and the lead, which separate accelerators would not.
- `follower_accuracy_gap`: the `grpo` follower's held-out accuracy after RL minus the lead's (goal >= -0.05).

Prints one JSON object as its last line.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import QUICK, size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = size(24, 4)  # RL steps of each run
EVAL = size(256, 32)  # held-out prompts of each evaluation
WARMUP = size(None, 40)  # the demo's supervised warm-up (None: its own, 300 steps)


def log(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def configs():
  """(lead config, job, arms config): the demo's, in `stream` mode; the samplers on 2 devices, each trainer on 2."""
  from streamrl_jax import gin_config
  from streamrl_jax.meshes import MeshConfig
  from streamrl_jax.arms.config import ArmConfig

  files = gin_config.run_files([])
  bindings = ["PipelineConfig.mode='stream'", f"PipelineConfig.steps={STEPS}", f"JobConfig.eval_prompts={EVAL}"]
  gin_config.parse(files, bindings)
  config, job = gin_config.build_run()
  rloo = gin_config.with_arms(config, job, [ROOT / "configs" / "arms" / "rloo.gin"], files, bindings).arms.followers
  config = dataclasses.replace(config, mesh=MeshConfig(sampler_devices=2, trainer_devices=2))
  if WARMUP is not None:
    job = dataclasses.replace(job, warmup_steps=WARMUP)
  grpo = ArmConfig("grpo", advantage=config.workflow.advantage, optimizer=config.trainer.optimizer, seed=config.seed,
                   objective=dataclasses.replace(config.trainer.objective, correction=("token_tis",)))
  return config, job, dataclasses.replace(config, arms=dataclasses.replace(config.arms, followers=(grpo, *rloo)))


def run(name: str, config, job, warm: Path, root: Path) -> dict:
  import shutil

  from streamrl_jax.records.metrics_log import read_metrics
  from streamrl_jax.pipeline.train_job import train_job

  workdir = root / name
  workdir.mkdir()
  shutil.copytree(warm, workdir / "warmup_model")
  log(f"arms: run {name!r}, {len(config.arms.followers) + 1} arm(s), {config.steps} steps ...")
  start = time.perf_counter()
  summary = train_job(config, job, workdir)
  rows = read_metrics(workdir)
  steady = [r["step_s"] for r in rows[2:]]
  arm_steps = len(rows) + sum(len(read_metrics(workdir / "arms" / a.name)) for a in config.arms.followers)
  return dict(seconds=round(time.perf_counter() - start, 1), lead_step_s=round(statistics.median(steady), 3),
              samples_generated=summary["counters"]["samples_generated"], arm_steps=arm_steps,
              accuracy_before=summary["accuracy_before"], accuracy_after=summary["accuracy_after"],
              arms=summary.get("arms", {}),
              skipped={a.name: read_metrics(workdir / "arms" / a.name)[-1].get("arm_steps_skipped", 0)
                       for a in config.arms.followers})


def main() -> dict:
  from streamrl_jax.models import save_hf
  from streamrl_jax.job.warmup import supervised_warmup

  config, job, with_arms = configs()
  model, tokenizer, _ = job.load_model()
  log("arms: supervised warm-up of the demo model ...")
  model = supervised_warmup(model, tokenizer, job.make_task(tokenizer), job,
                            config.sampler.engine.max_prompt_length + config.max_new_tokens)
  with tempfile.TemporaryDirectory() as tmp:
    warm = Path(tmp) / "warm"
    save_hf(model, warm)
    alone = run("alone", config, job, warm, Path(tmp))
    arms = run("arms", with_arms, job, warm, Path(tmp))
  per_arm_step = {k: r["samples_generated"] / r["arm_steps"] for k, r in (("alone", alone), ("arms", arms))}
  return dict(
      samples_generated_per_arm_step=round(per_arm_step["arms"] / per_arm_step["alone"], 3),
      lead_step_ratio=round(arms["lead_step_s"] / alone["lead_step_s"], 3),
      follower_accuracy_gap=round(arms["arms"]["grpo"] - arms["accuracy_after"], 4),
      rloo_accuracy_gap=round(arms["arms"]["rloo"] - arms["accuracy_after"], 4),
      lead_accuracy_alone=alone["accuracy_after"], lead_accuracy_with_arms=arms["accuracy_after"],
      accuracy_before=alone["accuracy_before"], arm_accuracy=arms["arms"], arm_steps_skipped=arms["skipped"],
      lead_step_s=dict(alone=alone["lead_step_s"], arms=arms["lead_step_s"]),
      samples_generated=dict(alone=alone["samples_generated"], arms=arms["samples_generated"]),
      arm_steps=dict(alone=alone["arm_steps"], arms=arms["arm_steps"]),
      run_seconds=dict(alone=alone["seconds"], arms=arms["seconds"]), steps=STEPS, eval_prompts=EVAL, quick=QUICK)


if __name__ == "__main__":
  from streamrl_jax import logs

  logs.configure(role="arms")  # the run's progress lines on stderr; the JSON alone on stdout
  print(json.dumps(main()))
