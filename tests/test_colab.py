"""The Colab notebooks in colab/: valid nbformat v4, committed without outputs, a papermill `parameters` cell
each, plain Python (no shell lines or magics), and every one runs headless (nbclient) at smoke sizes."""

import ast
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = ("quickstart", "run_modes", "scheduling", "simulator", "own_checkpoint", "arms")
CELL_TIMEOUT_S = 300
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in IPython's tracebacks


def _read(path: Path):
  return nbformat.read(path, as_version=nbformat.NO_CONVERT)


def _parameters_index(nb) -> int:
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
  assert len(tagged) == 1, f"want exactly one cell tagged 'parameters', found {len(tagged)}"
  return tagged[0]


def test_the_notebooks_are_the_expected_ones():
  assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("path", sorted(COLAB.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_is_valid_clean_and_parameterised(path):
  nb = _read(path)
  assert nb.nbformat == 4
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  for cell in code:
    assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: commit it without outputs"
    tree = ast.parse(cell.source)  # plain Python: no `!` shell lines, no `%` magics
    assert tree.body, f"{path.name}: an empty code cell"
  params = nb.cells[_parameters_index(nb)]
  assert params.cell_type == "code"
  for statement in ast.parse(params.source).body:  # papermill rewrites plain assignments only
    assert isinstance(statement, ast.Assign) and len(statement.targets) == 1, ast.unparse(statement)
    ast.literal_eval(statement.value)
  assert "SMOKE" in params.source and "WORKDIR" in params.source
  install = code[0].source
  assert "REPO_URL = " in install and "find_spec(\"streamrl_jax\")" in install and "pip" in install
  assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
  assert "jax.default_backend()" in "\n".join(c.source for c in code)


def test_notebooks_use_the_public_names():
  text = "\n".join(c.source for name in NOTEBOOKS for c in _read(COLAB / f"{name}.ipynb").cells)
  for name in ("streamrl train", "streamrl simulate", "streamrl_jax.job", "run_pipeline", "load_hf", "save_hf",
               "load_tokenizer", "PromptFile", "OnlineRanker", "dispatch_requests", "run_preset", "balanced_split",
               "measure_ptl_curve"):
    assert name in text, name


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> str:
  """A `python3` kernelspec that runs this interpreter (so the kernel sees this environment's packages,
  whatever other kernelspecs the machine has)."""
  from ipykernel.kernelspec import write_kernel_spec
  kernels = tmp_path_factory.mktemp("kernels")
  write_kernel_spec(str(kernels / "python3"))
  return str(kernels)


def _kernel_env(workdir: Path) -> dict:
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])  # no pip install
  flags = env.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  # conftest.py sets one XLA compilation cache for the session: notebooks share their compiled shapes.
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(workdir.parent / "xla-cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  return env


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_headless_at_smoke_sizes(name, tmp_path, kernel_specs):
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import AsyncKernelManager
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError
  from nbclient.util import run_sync

  nb = _read(COLAB / f"{name}.ipynb")
  workdir = tmp_path / "work"
  injected = nbformat.v4.new_code_cell(f"# Parameters injected by tests/test_colab.py\nSMOKE = True\nWORKDIR = {str(workdir)!r}")
  injected.metadata["tags"] = ["injected-parameters"]
  nb.cells.insert(_parameters_index(nb) + 1, injected)
  km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_specs]))
  client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, startup_timeout=120, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  start = time.perf_counter()
  try:
    client.execute(env=_kernel_env(tmp_path))
  except CellExecutionError as err:  # its message holds the failing cell's source and the traceback
    pytest.fail(f"{name}.ipynb: a cell failed\n{re.sub(ANSI, '', str(err))}", pytrace=False)
  finally:  # nbclient leaves a kernel it was given running: stop it (it holds a jax process's memory)
    if run_sync(km.is_alive)():
      run_sync(km.shutdown_kernel)(now=True)
    assert not run_sync(km.is_alive)()
  print(f"{name}.ipynb ran in {time.perf_counter() - start:.1f} s", file=sys.stderr)
  assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
