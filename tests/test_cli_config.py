"""Mesh configs, gin bindings and the `streamrl` command."""

import json
from pathlib import Path

import jax
import pytest

from streamrl_jax import cli, gin_config
from streamrl_jax.meshes import CPU_DEVICES_RULE, MeshConfig, MeshShape, build_meshes, cpu_device_count
from streamrl_jax.models.dtype_probe import PROBE_ENV


@pytest.mark.parametrize("config, expected", [
    (MeshConfig(), (MeshShape(4, 1, 1), MeshShape(1, 4, 1))),
    (MeshConfig(sampler_devices=6, trainer_tensor_parallel=2), (MeshShape(6, 1, 1), MeshShape(1, 1, 2))),
    (MeshConfig(trainer_devices=3), (MeshShape(5, 1, 1), MeshShape(1, 3, 1))),
    (MeshConfig(sampler_devices=2, trainer_devices=4, sampler_tensor_parallel=2), (MeshShape(1, 1, 2), MeshShape(1, 4, 1))),
])
def test_mesh_split(config, expected):
  assert config.split(8) == expected


@pytest.mark.parametrize("config, message", [
    (MeshConfig(sampler_devices=6, trainer_devices=4), "6 sampler \\+ 4 trainer devices, but 8"),
    (MeshConfig(sampler_devices=3, sampler_tensor_parallel=2), "sampler_tensor_parallel=2 does not divide 3"),
])
def test_mesh_split_errors(config, message):
  with pytest.raises(ValueError, match=message):
    config.split(8)


def test_meshes_are_disjoint():
  sampler, trainer = build_meshes(MeshConfig(sampler_devices=5, trainer_devices=2))
  assert sampler.devices.size == 5 and trainer.devices.size == 2
  assert not set(sampler.devices.flat) & set(trainer.devices.flat)
  assert len(jax.devices()) == 8


def test_gin_bindings_build_configs_and_reject_mistakes(tmp_path):
  gin_file = tmp_path / "x.gin"
  gin_file.write_text("MeshConfig.sampler_devices = 6\nMeshConfig.trainer_tensor_parallel = 2\n")
  gin_config.parse([gin_file], ["MeshConfig.trainer_devices = 2"])
  assert gin_config.build(MeshConfig) == MeshConfig(6, 2, 1, 2)
  with pytest.raises(ValueError, match="MeshConfig has no field 'bogus'"):
    gin_config.parse([], ["MeshConfig.bogus = 1"])
  with pytest.raises(ValueError, match="out of range"):
    gin_config.parse([], ["MeshConfig.sampler_devices = -1"])
    gin_config.build(MeshConfig)
  gin_config.parse()


@pytest.mark.parametrize("old, new", [("PipelineConfig.packing", "TrainerConfig.packing"),
                                      ("PipelineConfig.environment", "EnvConfig.environment"),
                                      ("JobConfig.model_dir", "JobConfig.model"),
                                      ("JobConfig.task", "TaskConfig.name"),
                                      ("JobConfig.prompt_file", "TaskConfig.prompt_file"),
                                      ("PipelineConfig.sampler_precision", "SamplerConfig.precision"),
                                      ("PipelineConfig.in_flight", "SamplerConfig.in_flight"),
                                      ("PipelineConfig.stop_grace_s", "WaitConfig.stop_grace_s"),
                                      ("PipelineConfig.dynamic_sampling", "ControllerConfig.dynamic_sampling"),
                                      ("PipelineConfig.arm_programs", "ArmsConfig.programs"),
                                      ("GKEConfig.sampler_replicas", "GKESamplersConfig.replicas")])
def test_a_key_that_moved_is_refused_naming_its_new_place(tmp_path, capsys, old, new):
  gin_file = tmp_path / "old.gin"
  gin_file.write_text(f"PipelineConfig.steps = 2\n{old} = 1\n")
  with pytest.raises(ValueError, match=f"{old} moved: set {new} instead \\({gin_file}\\)"):
    gin_config.parse([gin_file])
  assert cli.main(["info", "--set", f"{old}=1"]) == 2
  assert f"{old} moved: set {new} instead (--set" in capsys.readouterr().err
  gin_config.parse()


def test_info_prints_the_split(capsys):
  assert cli.main(["info", "--set", "MeshConfig.sampler_devices=6"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert info["device_count"] == 8
  assert info["sampler_mesh"] == {"data": 6, "fsdp": 1, "tensor": 1}
  assert info["trainer_mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}


@pytest.mark.parametrize("config, shared, cores, expected", [
    (MeshConfig(), True, 2, 1), (MeshConfig(), True, 16, 1), (MeshConfig(trainer_devices=2), True, 2, 2),
    (MeshConfig(), False, 1, 2), (MeshConfig(), False, 2, 2), (MeshConfig(), False, 6, 6),
    (MeshConfig(sampler_devices=3, trainer_devices=5), False, 2, 8),
])
def test_a_colocated_run_gets_one_cpu_device_and_two_meshes_one_per_core(config, shared, cores, expected):
  assert cpu_device_count(config, shared, cores) == expected


@pytest.mark.parametrize("argv, shared", [
    (["train", "--workdir", "w", "--set", "PipelineConfig.mode='colocated'"], True),
    (["train", "--workdir", "w", "--set", "PipelineConfig.mode='async'"], False),
    (["train", "--workdir", "w"], False),  # the demo's mode: async
    (["info", "--set", "PipelineConfig.mode='colocated'"], False),  # only a run's own meshes are shared
])
def test_the_cli_forces_the_devices_its_command_and_mode_need(monkeypatch, argv, shared):
  from streamrl_jax.commands import host_devices

  monkeypatch.setattr(host_devices, "cpu_cores", lambda: 3)
  assert cli.default_host_devices(cli.build_parser().parse_args(argv)) == (1 if shared else 3)
  gin_config.parse()


def test_info_shows_the_cpu_devices_a_run_of_the_config_forces(capsys):
  assert cli.main(["info", "--set", "PipelineConfig.mode='colocated'"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert info["cpu_devices"] == {"train": 1, "threads_per_device": cli.cpu_cores(), "rule": CPU_DEVICES_RULE}
  gin_config.parse()


@pytest.mark.parametrize("setting, forced, computes_in", [("auto", "float32", "float32"),
                                                      ("auto", "bfloat16", "bfloat16"),
                                                      ("bfloat16", "float32", "bfloat16")])
def test_info_names_the_dtype_this_machine_computes_in_and_why(capsys, monkeypatch, setting, forced, computes_in):
  monkeypatch.setenv(PROBE_ENV, forced)  # the probe's answer, faked: what it measures is tests/test_dtype_probe.py's
  assert cli.main(["info", "--set", f"JobConfig.compute_dtype='{setting}'"]) == 0
  shown = json.loads(capsys.readouterr().out)["compute_dtype"]
  assert {k: shown[k] for k in ("JobConfig.compute_dtype", "dtype", "weights_and_optimizer")} == {
      "JobConfig.compute_dtype": setting, "dtype": computes_in, "weights_and_optimizer": "float32"}
  assert (PROBE_ENV in shown["reason"]) == (setting == "auto")
  gin_config.parse()


def test_info_reports_bad_binding(capsys):
  assert cli.main(["info", "--set", "MeshConfig.nope=1"]) == 2
  assert "nope" in capsys.readouterr().err


def test_generate_demo_runs(capsys):
  assert cli.main(["generate", "--prompt", "1+1=", "--max-new-tokens", "5"]) == 0
  out = capsys.readouterr().out
  assert "'1+1=' ->" in out and "tokens/s to the stops" in out


def test_generate_counts_tokens_to_the_stop_and_hints_chat_when_a_chat_model_stops_at_once(capsys, monkeypatch):
  import jax.numpy as jnp

  import streamrl_jax.models as models

  model, tokenizer = cli._demo_model(0)
  tokenizer.chat_template = "{{ messages }}"  # a chat model's tokenizer (its template is not rendered without --chat)
  stop, a = tokenizer.eos_id, tokenizer.encode("7")[0]
  rows = {1: [stop, a, a, a, a], 2: [a, a, stop, a, a]}  # prompt 1 ends its turn at once, prompt 2 after 2 tokens
  monkeypatch.setattr(cli, "_demo_model", lambda seed: (model, tokenizer))
  monkeypatch.setattr(models, "generate", lambda *args, **kw: jnp.asarray([rows[1], rows[2]]))
  assert cli.main(["generate", "--prompt", "1+1=", "--prompt", "2+2=", "--max-new-tokens", "5"]) == 0
  out = capsys.readouterr().out
  assert "'1+1=' -> ''" in out and "'2+2=' -> '77'" in out
  assert "(4 of 10 decoded; batch 2)" in out  # 1 (the stop) + 3 (two tokens and the stop)
  assert "1 of 2 prompts: the model ended its turn at its first token" in out and "add --chat" in out


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs").glob("*.gin")), ids=lambda p: p.name)
def test_every_shipped_gin_file_builds(path):
  gin_config.parse([path])
  config, job = gin_config.build_run()
  assert config.steps >= 1 and job.task.name
  if path.name == "skew_cpu.gin":
    assert config.scheduling.policy == "skew_aware" and config.scheduling.instance_limit == 2
    assert config.scheduling.ranker.max_prompt_length == 32
  gin_config.parse()


def test_without_a_config_a_run_reads_the_cpu_demo_file_alone():
  """The CPU demo's values live in configs/demo_cpu.gin only: no --config reads that file, and what it builds
  differs from the library's defaults (which no demo value shadows)."""
  from streamrl_jax.settings import flat_settings

  assert gin_config.run_files([]) == [str(gin_config.DEMO_CONFIG)] and gin_config.DEMO_CONFIG.name == "demo_cpu.gin"
  assert gin_config.run_files(["x.gin"]) == ["x.gin"]
  gin_config.parse(gin_config.run_files([]))
  demo = flat_settings(*gin_config.build_run())
  gin_config.parse()
  defaults = flat_settings(*gin_config.build_run())
  differing = {k for k in demo if demo[k] != defaults[k]}
  assert {"PipelineConfig.steps", "EngineConfig.num_slots", "OptimizerConfig.learning_rate"} <= differing
  gin_config.parse()


def test_a_bare_word_is_a_string_where_the_key_takes_one_and_a_type_hint_elsewhere():
  gin_config.parse(bindings=["PipelineConfig.mode=stream", "TaskConfig.name=sums", "JobConfig.model=org/name@v1"])
  config, job = gin_config.build_run()
  assert (config.mode, job.task.name, job.model) == ("stream", "sums", "org/name@v1")
  with pytest.raises(gin_config.ConfigError) as err:
    gin_config.parse(bindings=["PipelineConfig.steps=many"])
  assert str(err.value) == ("--set 'PipelineConfig.steps=many': many is not a value of PipelineConfig.steps, which "
                            "takes int (e.g. --set PipelineConfig.steps=10)")
  gin_config.parse(bindings=["PipelineConfig.staleness=1", "TrainerConfig.packing=False"])  # not words: untouched
  assert gin_config.build_run()[0].trainer.packing is False
  gin_config.parse()


def test_a_config_named_without_its_gin_suffix_is_found_or_suggested(monkeypatch):
  root = Path(__file__).resolve().parent.parent
  monkeypatch.chdir(root)
  assert gin_config.run_files(["configs/demo_cpu"]) == ["configs/demo_cpu.gin"]
  assert gin_config.run_files(["smollm2_cpu"]) == [str(root / "configs" / "smollm2_cpu.gin")]
  with pytest.raises(gin_config.ConfigError, match=r"--config configs/demo_cpux: no such file; did you mean "
                                                   r"demo_cpu \(a shipped config\)\?"):
    gin_config.parse(gin_config.run_files(["configs/demo_cpux"]))


def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(monkeypatch, capsys):
  import signal

  from streamrl_jax import stopping

  def interrupted(args):
    raise KeyboardInterrupt  # as Ctrl-C while a command's modules load
  monkeypatch.setattr(cli, "default_host_devices", interrupted)
  try:
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "streamrl info: interrupted\n"
    stopping.early_interrupts()  # a Ctrl-C that Python dropped (in a gc callback) stops the run before it starts
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
      with stopping.StopRequest().installed():
        pytest.fail("the run started after a Ctrl-C")
  finally:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stopping._EARLY.clear()


def test_train_help_names_the_default_config_as_it_stands_and_that_config_and_set_repeat():
  parser = cli.build_parser()
  train = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" train"))
  text = " ".join(train.format_help().split())
  gin_config.parse(gin_config.run_files([]))
  config, job = gin_config.build_run()
  assert (f"configs/demo_cpu.gin: a tiny decoder, {job.warmup_steps} warm-up steps, {config.steps} {config.mode} "
          f"GRPO steps on {job.task.name}") in text
  assert "repeatable, read in order" in text and "repeatable, later ones win" in text
  gin_config.parse()
