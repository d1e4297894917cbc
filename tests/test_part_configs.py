"""Each part is built from its own config and the run's shape (`RunShape`); the whole `PipelineConfig` is read only
where the parts are built (issue 80): the runner, each program's entry, the job, the preflight, the config layer and
the CLI. Every config parameter carries its type."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "streamrl_jax"
# Where the parts are built (and the package that exports the config): the only modules that may name the whole
# pipeline config.
BUILDERS = ("pipeline/config.py", "pipeline/__init__.py", "pipeline/parts.py", "pipeline/runner.py",
            "pipeline/train_job.py", "pipeline/preflight.py", "pipeline/sampler/program.py",
            "pipeline/trainer/program.py", "arms/program.py", "agents/program.py", "gin_config.py", "arm_files.py",
            "config_listing.py", "cli.py", "commands/")


def _config_parameters(tree: ast.AST):
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      a = node.args
      for arg in a.posonlyargs + a.args + a.kwonlyargs:
        if arg.arg == "config" or arg.arg.endswith("_config"):
          yield node, arg


def unannotated(source: str) -> list[str]:
  """`function(parameter)` for each config parameter of `source` without a type."""
  return [f"{fn.name}({arg.arg})" for fn, arg in _config_parameters(ast.parse(source)) if arg.annotation is None]


def names_pipeline_config(source: str) -> list[int]:
  """Lines of `source` that name `PipelineConfig` in code (an import, an annotation, a call; not in prose)."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Name) and node.id == "PipelineConfig":
      lines.append(node.lineno)
    elif isinstance(node, ast.ImportFrom) and any(a.name == "PipelineConfig" for a in node.names):
      lines.append(node.lineno)
    elif isinstance(node, ast.arg) and node.annotation is not None and isinstance(node.annotation, ast.Constant) \
        and "PipelineConfig" in str(node.annotation.value):
      lines.append(node.lineno)
  return sorted(set(lines))


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_the_checks_find_what_they_look_for():
  source = ('from streamrl_jax.pipeline.config import PipelineConfig\n'
            'def a(config, model_config: int, x): ...\n'
            'def b(config: "PipelineConfig"): ...\n'
            'def c(config: PipelineConfig, engine_config): ...\n'
            '"""PipelineConfig in prose"""\n')
  assert unannotated(source) == ["a(config)", "c(engine_config)"]
  assert names_pipeline_config(source) == [1, 3, 4]
  assert names_pipeline_config('"""the whole PipelineConfig"""\ndef d(shape: RunShape): ...\n') == []


def test_only_the_builders_read_the_whole_pipeline_config():
  found = {module: lines for module, source in _modules() if not module.startswith(BUILDERS)
           if (lines := names_pipeline_config(source))}
  assert found == {}, f"modules below the builders that take the whole PipelineConfig (take the part's config and " \
                      f"RunShape): {found}"


def test_every_config_parameter_is_annotated():
  found = {module: names for module, source in _modules() if (names := unannotated(source))}
  assert found == {}
