"""A follower arm as its own program (`ArmsConfig.programs`): the lead trainer serves its stream over Arrow
Flight (threads of this process on loopback, each role on its own devices). A follower of another run is refused;
one that dies restarts from its checkpoint and trains every sample it had not saved, none twice; the lead waits
for it only at the end."""

import dataclasses
import json
import threading

import jax
import numpy as np
import pytest
from flax import nnx

import streamrl_jax.arms.program as follower_program
from streamrl_jax.messages import ArmJoin, ArmPoll, BadMessage
from streamrl_jax.meshes import MeshConfig
from streamrl_jax.models import Transformer
from streamrl_jax.arms.config import ArmConfig
from streamrl_jax.arms.config import ArmsConfig
from streamrl_jax.job.config import DemoModelConfig, JobConfig
from streamrl_jax.records.metrics_log import read_metrics
from streamrl_jax.arms.remote import RemoteArms
from streamrl_jax.pipeline.sampler.program import SamplerEndpoint, run_sampler
from streamrl_jax.pipeline.trainer.program import TrainerEndpoint, serve_training
from streamrl_jax.settings import flat_settings
from streamrl_jax.pipeline.run_hooks import RunHooks
from tests.pipeline_setup import BASE, TOKENIZER, DigitTask
from tests.test_remote_pipeline import FAST, FAST_CONTROL

JOB = JobConfig(demo=DemoModelConfig(hidden_size=32, num_layers=2), warmup_steps=0, eval_prompts=4)
CONFIG = dataclasses.replace(BASE, mode="stream", controller=FAST_CONTROL, mesh=MeshConfig(sampler_devices=4,
                                                                                           trainer_devices=2),
                             arms=ArmsConfig(programs=True, followers=(ArmConfig("rloo", advantage="rloo"),)))


def test_the_lead_refuses_unknown_arms_other_runs_and_other_streams():
  settings = flat_settings(CONFIG, JOB)
  arms = RemoteArms(CONFIG.shape, CONFIG.arms, "run-a", 0, settings)
  assert arms.join(ArmJoin("rloo", "", settings)).run_id == "run-a"
  with pytest.raises(BadMessage, match=r"arm 'x' is not an arm of this run \(its arms: \['rloo'\]\)"):
    arms.join(ArmJoin("x", "", settings))
  with pytest.raises(BadMessage, match="arm 'rloo' belongs to run 'run-b' .* this lead runs run-a"):
    arms.poll(ArmPoll("rloo", "run-b", 0))
  other = dict(settings, **{"PipelineConfig.group_size": "8"})
  with pytest.raises(BadMessage, match="arm 'rloo' runs another stream than the lead: 1 settings differ, first "
                                       "'PipelineConfig.group_size'"):
    arms.join(ArmJoin("rloo", "run-a", other))
  own = dict(settings, **{"WorkflowConfig.advantage": "'rloo'", "OptimizerConfig.learning_rate": "0.5"})
  assert arms.join(ArmJoin("rloo", "run-a", own)).steps == CONFIG.steps  # an arm's own keys may differ
  with pytest.raises(ValueError, match="ArmsConfig.programs: .* SamplerConfig.precision='float32' and no LoRA"):
    dataclasses.replace(CONFIG, sampler=dataclasses.replace(CONFIG.sampler, precision="int8"))


def test_a_follower_program_restarts_from_its_checkpoint_and_trains_each_sample_once(tmp_path, monkeypatch):
  task, settings = DigitTask(max_digits=3), flat_settings(CONFIG, JOB)
  workdir, errors, outcomes = tmp_path / "arms" / "rloo", [], {}
  fail = {"at": 2}
  real_parts = follower_program.arm_parts

  def failing_parts(name, source, periodic, params):  # the first follower program dies writing its step 2
    def dying(row):
      if row["step"] == fail["at"]:
        raise RuntimeError("injected: the follower dies")
      return {}
    return (dying, *real_parts(name, source, periodic, params))
  monkeypatch.setattr(follower_program, "arm_parts", failing_parts)

  def follow(**kwargs):
    return follower_program.follow_lead(CONFIG, JOB, "rloo", devices=jax.devices()[6:8], flight_config=FAST,
                                        **kwargs)

  def follower(address: str):
    try:
      stranger = tmp_path / "stranger"
      stranger.mkdir()
      (stranger / "run_id").write_text("run-b")
      with pytest.raises(BadMessage, match="arm 'rloo' belongs to run 'run-b'"):
        follow(connect=address, workdir=stranger)
      with pytest.raises(RuntimeError, match="injected"):
        follow(connect=address, workdir=workdir)
      outcomes["first_rows"] = [r["step"] for r in read_metrics(workdir)]
      fail["at"] = None
      outcomes["summary"] = follow(connect=address, workdir=workdir)
    except BaseException as err:
      errors.append(err)

  def sampler(address: str):
    try:
      run_sampler(CONFIG, JOB.model_config(TOKENIZER), TOKENIZER, task,
                  endpoint=SamplerEndpoint(address, "sampler-0", flight_config=FAST, settings=settings),
                  devices=jax.devices()[:4])
    except BaseException as err:
      errors.append(err)

  def listening(address: str):
    for target, name in ((sampler, "sampler-0"), (follower, "arm-test")):
      threading.Thread(target=target, args=(address,), daemon=True, name=name).start()

  result = serve_training(CONFIG, Transformer(JOB.model_config(TOKENIZER), rngs=nnx.Rngs(0)), TOKENIZER, task,
                          settings=settings, endpoint=TrainerEndpoint(flight_config=FAST, on_listening=listening),
                          hooks=RunHooks(run_id="run-a"), devices=jax.devices()[4:6])
  for thread in [t for t in threading.enumerate() if t.name in ("sampler-0", "arm-test")]:
    thread.join(timeout=120)
  assert not errors, errors
  assert len(result.metrics) == 3 and result.arms == {}
  assert outcomes["first_rows"] == [1]  # it died at step 2, after step 1's checkpoint
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3] and {r["arm"] for r in rows} == {"rloo"}
  counters = outcomes["summary"]["counters"]
  # the restarted program read the stream from the start again: step 1's samples were not trained a second time
  assert counters["unique_samples_trained"] == counters["samples_planned"] == 2 * CONFIG.samples_per_step
  assert counters["duplicate_samples"] == CONFIG.samples_per_step and counters["arm_steps_skipped"] == 0
  assert (workdir / "run_id").read_text() == "run-a" and (workdir / "final_model" / "config.json").exists()
  assert json.loads((workdir / "summary.json").read_text())["advantage"] == "rloo"
  for lead_row, row in zip(result.metrics, rows):
    assert row["reward_mean"] == lead_row["reward_mean"]  # the lead's samples
  assert np.isfinite(rows[-1]["arm_policy_divergence"]) and rows[-1]["arm_policy_divergence"] > 0


def test_launch_local_starts_a_follower_program_per_arm_in_the_leads_workdir(tmp_path):
  from streamrl_jax.cli import build_parser
  from streamrl_jax.commands.launch_local import Supervisor, _check_arms, plan_children

  arm = tmp_path / "rloo.gin"
  arm.write_text("WorkflowConfig.advantage = 'rloo'\nObjectiveConfig.correction = 'token_tis'\n")
  args = build_parser().parse_args(["launch", "local", "--workdir", str(tmp_path / "run"), "--arms", str(arm),
                                    "--set", "PipelineConfig.mode='stream'", "--set", "ArmsConfig.programs=True"])
  programs = _check_arms(args)
  assert programs == (("rloo", str(arm)),)
  children = plan_children(args, None, programs)
  trainer, sampler, follower = children
  assert trainer.argv[trainer.argv.index("--arms") + 1] == str(arm)
  assert follower.name == "arm-rloo" and follower.argv[3] == "follower"
  assert follower.argv[follower.argv.index("--workdir") + 1] == str(tmp_path / "run" / "arms" / "rloo")
  connect = follower.argv[follower.argv.index("--connect") + 1]
  assert connect == sampler.argv[sampler.argv.index("--connect") + 1]
  supervisor = Supervisor(children, 1, tmp_path / "run")
  assert supervisor.samplers() == [sampler] and supervisor.followers() == [follower]
  args.set = ["PipelineConfig.mode='stream'"]  # arms in the trainer's program: no follower processes
  assert _check_arms(args) == ()
  bad = tmp_path / "bad.gin"
  bad.write_text("PipelineConfig.group_size = 2\n")
  args.arms = [str(bad)]
  with pytest.raises(ValueError, match="arm 'bad': PipelineConfig.group_size=2 differs from the lead's"):
    _check_arms(args)
