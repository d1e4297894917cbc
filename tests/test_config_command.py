"""`streamrl config` (every key, its type and help; its output a --config that builds the same configs), config
mistakes said in one line before anything starts, values checked against the fields' annotations, and help on
every flag of every subcommand."""

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Optional

import pytest

from streamrl_jax import cli, gin_config
from streamrl_jax.config_listing import field_help
from streamrl_jax.config_types import ConfigError, checked, type_name
from streamrl_jax.job.config import JobConfig
from streamrl_jax.scheduling import SchedulingConfig
from streamrl_jax.settings import flat_settings
from streamrl_jax.sim.preset_names import PRESETS

LINE = re.compile(r"^(#\s)?([A-Za-z]+Config)\.(\w+) = (.+?)  # (.+)$")


def listing(capsys, *args) -> str:
  assert cli.main(["config", *args]) == 0
  return capsys.readouterr().out


def test_config_lists_every_key_once_with_its_type_and_help(capsys):
  out = listing(capsys)
  keys = {}
  for line in out.splitlines():
    if match := LINE.match(line):
      commented, cls, field, _, note = match.groups()
      keys[f"{cls}.{field}"] = keys.get(f"{cls}.{field}", 0) + 1
      if not commented:
        kind, _, help_text = note.partition(": ")
        assert kind and help_text.strip(), line  # `# type: help`, both said
  assert sorted(keys) == sorted(gin_config.KNOWN_KEYS) and set(keys.values()) == {1}
  assert "# EngineConfig.max_new_tokens = " in out and "set from PipelineConfig.max_new_tokens" in out
  assert "PipelineConfig.steps = 80  # int: " in out  # the demo's value (configs/demo_cpu.gin), not the default
  assert "GKEConfig.image = ''" in out and "`streamrl launch gke` would refuse these: GKEConfig.image" in out


def test_every_key_has_help_in_its_dataclass():
  for cls in gin_config.CONFIG_CLASSES:
    helps = field_help(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not helps.get(f.name)
               and not dataclasses.is_dataclass(f.default)]
    assert not missing, f"{cls.__name__}: {missing} have no comment to show as help"


def test_the_listing_is_a_config_that_builds_the_same_run(tmp_path, capsys):
  sets = ["PipelineConfig.steps=3", "SchedulingConfig.ptl_curve=[[1, 0.5], [4, 1.0]]", "OptimizerConfig.b1=0",
          "EngineConfig.short_attention_windows=(32, 64)", "TaskConfig.system_prompt='say \"hi\"\\n'",
          "GKEConfig.image='img:1'", "GKEConfig.bucket='gs://my-bucket/runs'", "FlightConfig.weight_streams=2"]
  text = listing(capsys, *(a for s in sets for a in ("--set", s)))
  gin_config.parse(gin_config.run_files([]), sets)
  expected = (*gin_config.build_run(), gin_config.build_flight(), gin_config.build_gke())
  saved = tmp_path / "resolved.gin"
  saved.write_text(text)
  gin_config.parse([saved])
  again = (*gin_config.build_run(), gin_config.build_flight(), gin_config.build_gke())
  gin_config.parse()
  assert again == expected
  assert again[0].scheduling.ptl_curve == ((1, 0.5), (4, 1.0)) and again[0].trainer.optimizer.b1 == 0.0
  assert flat_settings(*again) == flat_settings(*expected)


MISTAKES = [
    (["--set", "PipelineConfig.steps='two'"], "PipelineConfig.steps = 'two': expected int, got str"),
    (["--set", "PipelineConfig.steps=2.5"], "PipelineConfig.steps = 2.5: expected int, got float"),
    (["--set", "SamplerConfig.in_flight=1"], "SamplerConfig.in_flight = 1: expected bool, got int"),
    (["--set", "EngineConfig.short_attention_windows=(16, 'x')"],
     "EngineConfig.short_attention_windows = (16, 'x'): expected tuple[int, ...], got tuple"),
    (["--set", "SchedulingConfig.ptl_curve=((1, 2, 3),)"], "expected tuple[tuple[int, float], ...]"),
    (["--set", "JobConfig.model=None"], "JobConfig.model = None: expected str, got NoneType"),
    (["--set", "PipelineConfig.steps=(2"], "--set 'PipelineConfig.steps=(2': a bracket or quote is not closed"),
    (["--set", "PipelineConfig.steps=2 3"], "--set 'PipelineConfig.steps=2 3': Expected newline"),
    (["--set", "PipelineConfig.stepz=2"], "PipelineConfig has no field 'stepz'; did you mean PipelineConfig.steps?"),
    (["--set", "PipelineConfig.num_slots=2"], "did you mean EngineConfig.num_slots?"),
    (["--set", "PipelineConfg.steps=2"], "unknown config class 'PipelineConfg'; did you mean PipelineConfig.steps?"),
    (["--set", "ModelConfig.num_layers=3"], "ModelConfig is not a config to bind; a model's shape comes from"),
    (["--set", "PipelineConfig.sampler=None"], "PipelineConfig.sampler is built from the SamplerConfig.* keys"),
    (["--set", "PipelineConfig.mode='pipelined'"], "PipelineConfig.mode='pipelined'; known:"),
]


@pytest.mark.parametrize("command", ["train", "config"])
@pytest.mark.parametrize("args, said", MISTAKES, ids=[m[0][1] for m in MISTAKES])
def test_a_config_mistake_is_one_line_and_exit_2(tmp_path, capsys, command, args, said):
  workdir = ["--workdir", str(tmp_path / "run")] if command == "train" else []
  assert cli.main([command, *workdir, *args]) == 2
  out, err = capsys.readouterr()
  assert said in err and err.startswith(f"streamrl {command}: error: ") and err.count("\n") == 1, err
  assert "Traceback" not in err + out and "%|" not in err + out  # no traceback, no progress bar
  assert not (tmp_path / "run").exists()  # nothing started


def test_a_mistake_in_a_file_names_the_file_and_its_line(tmp_path, capsys):
  bad = tmp_path / "bad.gin"
  bad.write_text("PipelineConfig.steps = 3\nPipelineConfig.mode = 'async\nPipelineConfig.seed = 1\n")
  unclosed = tmp_path / "unclosed.gin"
  unclosed.write_text("PipelineConfig.steps = 3\nSchedulingConfig.ptl_curve = ((1, 0.1),\nPipelineConfig.seed = 1\n")
  missing = tmp_path / "missing.gin"
  for path, said in ((bad, f"{bad}: Unable to parse value (line 2: \"PipelineConfig.mode = 'async\")"),
                     (unclosed, f"{unclosed}: a bracket or quote is not closed (line 2: "),
                     (missing, f"--config {missing}: no such file")):
    assert cli.main(["train", "--workdir", str(tmp_path / "run"), "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert said in err and err.count("\n") == 1 and err.count(str(path)) == 1, err


def test_values_are_checked_against_annotations():
  assert checked(SchedulingConfig, "ptl_curve", [[1, 2]]) == ((1, 2.0),)  # lists read as tuples, ints as floats
  assert checked(SchedulingConfig, "alpha", 1) == 1.0 and isinstance(checked(SchedulingConfig, "alpha", 1), float)
  for bad in (True, "0.2", None):
    with pytest.raises(ConfigError, match=r"SchedulingConfig\.alpha = .*: expected float"):
      checked(SchedulingConfig, "alpha", bad)
  assert type_name(Optional[int]) == "int | None" and type_name(tuple[str, ...]) == "tuple[str, ...]"
  assert type_name(tuple[int, float]) == "tuple[int, float]"
  for cls in gin_config.CONFIG_CLASSES:  # every default is a value of its own field's type
    for field in dataclasses.fields(cls):
      if field.default is not dataclasses.MISSING and not dataclasses.is_dataclass(field.default):
        assert checked(cls, field.name, field.default) == field.default, (cls, field.name)
  with pytest.raises(ConfigError, match=r"JobConfig\.warmup_steps = False: expected int, got bool"):
    checked(JobConfig, "warmup_steps", False)


def _parsers(parser: argparse.ArgumentParser, path=("streamrl",)):
  yield path, parser
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, sub in action.choices.items():
        yield from _parsers(sub, path + (name,))


def test_every_flag_of_every_subcommand_has_help():
  seen = set()
  for path, parser in _parsers(cli.build_parser()):
    seen.add(" ".join(path))
    for action in parser._actions:
      if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
        continue
      assert action.help and action.help.strip(), f"{' '.join(path)} {action.option_strings or action.dest}"
  assert {"streamrl config", "streamrl train", "streamrl generate", "streamrl simulate", "streamrl launch local",
          "streamrl launch gke", "streamrl trainer", "streamrl sampler"} <= seen


def test_simulate_help_lists_its_presets(capsys):
  with pytest.raises(SystemExit):
    cli.main(["simulate", "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert all(name in out for name in PRESETS)
  with pytest.raises(SystemExit) as exited:
    cli.main(["simulate", "--preset", "nope", "--out", "x"])
  assert exited.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"\b(" + "|".join([c.__name__ for c in gin_config.CONFIG_CLASSES] + list(gin_config.NOT_BOUND))
                   + r")\.([A-Za-z_]\w*)")


def keys_named(text: str) -> set[str]:
  """Every `Class.field` a text names, for the config classes (and the classes that are not bound), but in the
  lines that show a mistake being refused (`$ streamrl ...` then `...: error: ...`)."""
  shown = "\n".join(line for line in text.splitlines() if not line.startswith("$ ") and ": error: " not in line)
  return {f"{cls}.{field}" for cls, field in NAMED.findall(shown)}


def test_every_key_the_docs_name_is_a_key_streamrl_config_lists(capsys):
  listed = {f"{m.group(2)}.{m.group(3)}" for m in map(LINE.match, listing(capsys).splitlines()) if m}
  listed |= {f"{cls.__name__}.{f.name}" for cls in gin_config.CONFIG_CLASSES for f in dataclasses.fields(cls)
             if "bound_by" in f.metadata}  # fields set otherwise than by gin (ArmsConfig.followers: --arms)
  files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "colab").glob("*.ipynb"),
           *(p for folder in ("configs", "examples", "launchers") for p in (ROOT / folder).rglob("*")
             if p.suffix in (".gin", ".md"))]
  named = {path.relative_to(ROOT): keys_named(path.read_text()) for path in files}
  assert sum(map(len, named.values())) > 100  # the scan reads what it should
  wrong = {str(path): sorted(keys - listed) for path, keys in named.items() if keys - listed}
  assert not wrong, f"keys named that `streamrl config` does not list: {wrong}"
  assert keys_named("set `JobConfig.model_dir` or ModelConfig.remat") - listed == {"JobConfig.model_dir",
                                                                                    "ModelConfig.remat"}
  assert not keys_named("$ streamrl train --set 'JobConfig.bad=1'\nstreamrl train: error: JobConfig.bad: ...")
