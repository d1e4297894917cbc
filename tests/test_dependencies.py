"""Every dependency pyproject.toml declares is used and bounded: a runtime one is imported by the package, a test
one by the tests or benchmarks, and each has an upper bound (or an exact pin), so a new major release cannot
break an install unseen. The few used without an import say why in `USED_WITHOUT_IMPORT`."""

import ast
import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# distribution -> why it is needed though nothing of ours imports it
USED_WITHOUT_IMPORT = {
    "accelerate": "transformers refuses to load a GGUF file without it (tests/test_gguf.py, benchmarks/real_model.py)",
    "libtpu": "jax loads it as its TPU backend's plugin: tests/test_plan.py compiles for a TPU topology, no TPU here",
    "pytest-xdist": "pytest's `-n` (pyproject.toml's addopts): the tests spread over one worker process per core",
    "tensorboard": "the `tensorboard --logdir WORKDIR` command of the viz extra reads a run's event files",
}
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def _declared() -> dict[str, list[tuple[str, str]]]:
  """{group ("runtime" or an extra's name): [(distribution, version spec), ...]}."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  groups = {"runtime": project["dependencies"], **project["optional-dependencies"]}
  out = {}
  for group, requirements in groups.items():
    out[group] = []
    for text in requirements:
      name, _, spec = REQUIREMENT.match(text).groups()
      out[group].append((_normal(name), spec.strip()))
  return out


def _normal(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _imported(*folders: str) -> set[str]:
  """Top-level module names imported anywhere in `folders` (.py files and notebook code cells), in functions too."""
  names = set()
  for folder in folders:
    for path in (ROOT / folder).rglob("*"):
      if path.suffix == ".py":
        sources = [path.read_text()]
      elif path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        sources = ["".join(line for line in c["source"] if not line.lstrip().startswith(("!", "%")))
                   for c in cells if c["cell_type"] == "code"]
      else:
        continue
      for source in sources:
        for node in ast.walk(ast.parse(source, str(path))):
          if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
          elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.split(".")[0])
  return names


def _modules_of() -> dict[str, set[str]]:
  """{distribution: its top-level modules}, from what is installed."""
  out: dict[str, set[str]] = {}
  for module, distributions in importlib.metadata.packages_distributions().items():
    for distribution in distributions:
      out.setdefault(_normal(distribution), set()).add(module)
  return out


def test_every_declared_dependency_is_imported_where_it_is_needed():
  declared, modules = _declared(), _modules_of()
  package, everything = _imported("streamrl_jax"), _imported("streamrl_jax", "tests", "benchmarks", "examples", "colab")
  unused = []
  for group, requirements in declared.items():
    where = package if group == "runtime" else everything
    for name, _ in requirements:
      provides = modules.get(name, {name.replace("-", "_")})  # not installed here (an accelerator's extra): its name
      if name not in USED_WITHOUT_IMPORT and not provides & where:
        unused.append(f"{name} ({group}; provides {sorted(provides)})")
  assert not unused, f"declared in pyproject.toml, imported nowhere it is needed: {unused}"
  names = {name for requirements in declared.values() for name, _ in requirements}
  assert set(USED_WITHOUT_IMPORT) <= names, "USED_WITHOUT_IMPORT names a dependency that is no longer declared"


def test_every_declared_dependency_has_an_upper_bound():
  loose = [f"{name}{spec} ({group})" for group, requirements in _declared().items() for name, spec in requirements
           if not re.search(r"(<|==|~=)", spec)]
  assert not loose, f"no upper bound (add `<NEXT_MAJOR`): {loose}"


def test_the_scan_sees_imports_in_functions_and_notebooks():
  """The scan itself can fail: it finds an import made inside a function and one in a notebook cell."""
  assert "tensorboardX" in _imported("streamrl_jax")  # imported inside a function of metrics_log
  assert "streamrl_jax" in _imported("colab")
