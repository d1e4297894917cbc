"""Configuration and resume mistakes are reported before any model is built or anything is compiled: each
case runs the real command line in-process with model loading booby-trapped and jax's compile events
counted, and must end with exit code 2 and a message naming what to change."""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from streamrl_jax import cli, gin_config
from streamrl_jax.settings import flat_settings
from streamrl_jax.pipeline import preflight
from streamrl_jax.job.config import JobConfig
from streamrl_jax.records import run_files
from tests.checkpoints import word_checkpoint

COMPILE_EVENTS = []


def _on_event(event: str, duration: float, **kwargs) -> None:
  if event.startswith("/jax/core/compile/"):
    COMPILE_EVENTS.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture
def nothing_built(monkeypatch):
  """Fails the test if a model is loaded or built; yields the list of compile events seen meanwhile."""
  def trap(self):
    raise AssertionError("a model was built before the mistake was reported")
  monkeypatch.setattr(JobConfig, "load_model", trap)
  COMPILE_EVENTS.clear()
  yield COMPILE_EVENTS
  gin_config.parse()  # leave no bindings behind for other tests


def fake_checkpoint(workdir, step: int = 3) -> None:
  manager = ocp.CheckpointManager(workdir / "checkpoints", options=ocp.CheckpointManagerOptions(create=True))
  manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave({"x": np.ones(2, np.float32)})))
  manager.wait_until_finished()
  manager.close()


def prompt_file(tmp_path):
  path = tmp_path / "prompts.jsonl"
  rows = [{"question": "what is 1 plus 1 ?", "answer": "2"},
          {"question": "what is " + "9 plus " * 40 + "1 ?", "answer": "361"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _model_dir(name, directory):
  """The word-level checkpoint, spoilt as `name` says: a template that does not compile, one that refuses, or
  a generation_config.json that is not JSON."""
  settings = json.loads((directory / "tokenizer_config.json").read_text())
  if name == "broken":
    settings["chat_template"] = "{% for m in messages %}{{ m['content'] }}"
  elif name == "refusing":
    settings["chat_template"] = "{{ raise_exception('no user turns here') }}"
  elif name == "badgen":
    (directory / "generation_config.json").write_text('{"eos_token_id": [1,')
  (directory / "tokenizer_config.json").write_text(json.dumps(settings))
  return directory


CASES = {
    "resume without a checkpoint": (["train", "--resume"], None, "--resume: there is no checkpoint in"),
    "a bucket URL as workdir": (["train", "--workdir", "gs://bucket/run"], None, "mount the bucket"),
    "meshes larger than the machine": (["train", "--set", "MeshConfig.sampler_devices=6", "--set",
                                        "MeshConfig.trainer_devices=6"], None, "devices"),
    "instances that do not divide the sampler": (["train", "--set", "SchedulingConfig.max_instances=3"], None,
                                                "SchedulingConfig.max_instances=3 does not divide the 4 sampler"),
    "generated prompts too long": (["train", "--set", "EngineConfig.max_prompt_length=4"], None,
                                   "exceed EngineConfig.max_prompt_length=4"),
    "a file prompt too long": (["train", "--set", "TaskConfig.name='file'", "--set", "JobConfig.model='{hf}'",
                                "--set", "TaskConfig.prompt_file='{prompts}'"], None, "prompts.jsonl, row 1: "),
    "a fresh start over checkpoints": (["train"], "checkpoint", "holds checkpoints up to step 3: continue them with"),
    "a resume with another model": (["train", "--resume", "--set", "DemoModelConfig.hidden_size=32"], "settings",
                                    "DemoModelConfig.hidden_size: 64 -> 32"),
    "colocated as a trainer program": (["trainer", "--set", "PipelineConfig.mode='colocated'"], None,
                                       "time-shares one mesh in one program"),
    "a chat template that does not compile": (["train", "--set", "TaskConfig.name='file'", "--set",
                                               "JobConfig.model='{broken}'", "--set",
                                               "TaskConfig.prompt_file='{prompts}'"], None,
                                              "broken: the chat template does not compile: "),
    "a chat template that refuses": (["train", "--set", "TaskConfig.name='file'", "--set", "TaskConfig.chat=True",
                                      "--set", "JobConfig.model='{refusing}'", "--set",
                                      "TaskConfig.prompt_file='{prompts}'"], None,
                                     "refusing: the chat template raised: no user turns here"),
    "a generation config that is not JSON": (["train", "--set", "TaskConfig.name='file'", "--set",
                                              "JobConfig.model='{badgen}'", "--set",
                                              "TaskConfig.prompt_file='{prompts}'"], None,
                                             "generation_config.json is not valid JSON"),
    "more stop tokens than the engine takes": (["train", "--set", "EnvConfig.environment='calculator'", "--set",
                                                "EngineConfig.max_stop_tokens=1"], None,
                                               "more than EngineConfig.max_stop_tokens=1: set it to 2"),
    "an activation budget below one row": (["train", "--set", "TrainerConfig.activation_budget_mb=1"], None,
                                           "TrainerConfig.activation_budget_mb=1 holds"),
    "a model larger than the machine's memory": (["train", "--set", "DemoModelConfig.hidden_size=16384"], None,
                                                 "of memory (runtime 1.0 GiB, trainer state "),
    "a sampler larger than its machine": (["sampler", "--connect", "127.0.0.1:9", "--set",
                                           "MeshConfig.sampler_devices=16"], None,
                                          "MeshConfig.sampler_devices=16 but this sampler has 8 devices"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mistakes_are_reported_before_any_model_or_compile(case, tmp_path, capsys, hf_dirs, nothing_built):
  args, before, message = CASES[case]
  workdir = tmp_path / "run"
  if before == "checkpoint":
    fake_checkpoint(workdir)
  elif before == "settings":
    fake_checkpoint(workdir)
    gin_config.parse()
    run_files.write_settings(workdir, flat_settings(*gin_config.build_run()))  # the default hidden size, 64
  nothing_built.clear()
  fill = dict(prompts=prompt_file(tmp_path))
  for name in ("hf", "broken", "refusing", "badgen"):
    if any("{" + name + "}" in a for a in args):
      fill[name] = _model_dir(name, word_checkpoint(hf_dirs, tmp_path / name))
  argv = [a.format(**fill) for a in args]
  if argv[0] != "sampler" and "--workdir" not in argv:
    argv[1:1] = ["--workdir", str(workdir)]
  code = cli.main(argv)
  err = capsys.readouterr().err
  assert code == 2 and message in err, err
  assert nothing_built == [], f"compiled before the error: {nothing_built}"


def test_auto_resume_follows_the_checkpoint_and_the_settings(tmp_path):
  settings = {"PipelineConfig.steps": "10", "DemoModelConfig.hidden_size": "64"}
  assert preflight.check_resume(tmp_path, settings, "auto", None) is False
  run_files.write_settings(tmp_path, settings)
  assert preflight.check_resume(tmp_path, {**settings, "PipelineConfig.steps": "20"}, "auto", 4) is True
  with pytest.raises(ValueError, match="DemoModelConfig.hidden_size: 64 -> 32"):
    preflight.check_resume(tmp_path, {**settings, "DemoModelConfig.hidden_size": "32"}, "auto", 4)


def test_a_workdir_written_before_keys_moved_resumes_under_their_new_names(tmp_path):
  run_files.write_settings(tmp_path, {"SamplerConfig.precision": "'int8'", "SamplerConfig.in_flight": "True"})
  now = {"SamplerConfig.precision": "'int8'", "SamplerConfig.in_flight": "True"}
  assert preflight.check_resume(tmp_path, now, "auto", 4) is True
  with pytest.raises(ValueError, match="SamplerConfig.in_flight: True -> False"):
    preflight.check_resume(tmp_path, {**now, "SamplerConfig.in_flight": "False"}, "auto", 4)


def test_the_host_memory_estimate_adds_up_by_hand():
  """The parts of a run's host memory, worked by hand for a small model, and the refusal when they do not fit."""
  gin_config.parse([], ["SamplerConfig.precision='bfloat16'", "EngineConfig.num_slots=4"])
  config, job = gin_config.build_run()
  gin_config.parse()
  model_config, _ = job.model_spec()
  n, c, e = model_config.param_count(), model_config, config.sampler.engine
  parts = preflight.host_memory_parts(config, model_config, "train")
  assert parts["trainer state"] == 16 * n  # float32 parameters, summed gradient and two Adam moments
  assert parts["sampler weights"] == 2 * n  # bfloat16
  int8 = dataclasses.replace(config, sampler=dataclasses.replace(config.sampler, precision="int8"))
  assert preflight.host_memory_parts(int8, model_config, "sampler")["sampler weights"] == 4 * n  # computed in float32
  assert parts["sampler KV cache"] == config.scheduling.instance_limit * 4 * (
      2 * c.num_layers * e.cache_length * c.num_kv_heads * c.head_dim * 4)  # keys and values, float32
  assert set(preflight.host_memory_parts(config, model_config, "sampler")) == {"runtime", "sampler weights",
                                                                                 "sampler KV cache"}
  need = sum(parts.values())
  preflight.check_host_memory(config, model_config, "train", need)  # just fits
  preflight.check_host_memory(config, model_config, "train", 0)  # not known: no check
  with pytest.raises(ValueError, match=r"this run needs about .* GiB of memory .* available: use a smaller model"):
    preflight.check_host_memory(config, model_config, "train", need - 1)
