"""The four graphs whose trainer stages read a sample's tokens (`kl_reference`, `distill`, `judge`, `ppo`) on a trainer
of 2 and of 4 processes (`jax.distributed` on loopback, 2 CPU devices each; tests/stage_processes.py): every process
holds its own samples' tokens alone, and the stages' fields, their step sums and the critic's update equal a trainer of
one process's on the same samples."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.models.hf_io import save_hf
from tests.processes import free_port
from tests.stage_processes import GRAPHS, MODEL

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # four graphs a process
# each graph's fields its trainer stages write: per sample (every process holds every row's) or per token (the owner's)
WRITTEN = {"kl_reference": ({"rewards", "advantages"}, {"reference_logprobs"}),
           "distill": (set(), {"teacher_logprobs", "advantages"}),
           "judge": ({"rewards", "advantages"}, set()),
           "ppo": (set(), {"values", "advantages", "returns"})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  root = tmp_path_factory.mktemp("stage-models")
  for name, seed in (("teacher", 5), ("judge", 6)):
    save_hf(Transformer(ModelConfig(**MODEL), rngs=nnx.Rngs(seed)), root / name)
  return root


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> Path:
  """Every graph's npz of a trainer of 1, 2 and 4 processes (each process runs the four graphs in turn)."""
  out = tmp_path_factory.mktemp("stage-runs")
  for processes in (1, 2, 4):
    _run(processes, out, models)
  return out


def _run(processes: int, out: Path, models: Path) -> None:
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "tests.stage_processes", str(out), str(p), str(processes), str(port),
                             str(models)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for p in range(processes)]
  try:
    for proc in procs:
      said, _ = proc.communicate(timeout=TIMEOUT_S)
      assert proc.returncode == 0, said[-3000:]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def _parts(runs: Path, graph: str, processes: int) -> list[dict]:
  return [dict(np.load(runs / f"{graph}-{processes}-{p}.npz")) for p in range(processes)]


@pytest.mark.slow
@pytest.mark.parametrize("graph", GRAPHS)
def test_a_graphs_stages_on_several_trainer_processes_equal_one_process(graph, runs):
  one = _parts(runs, graph, 1)[0]
  samples, tokens = WRITTEN[graph]
  for processes in (2, 4):
    parts = _parts(runs, graph, processes)
    for part in parts:
      for field in samples:  # every process holds every sample's value
        np.testing.assert_allclose(part[f"field_{field}"], one[f"field_{field}"], rtol=1e-4, atol=1e-6, err_msg=field)
      for field in tokens:  # a sample's tokens' values on its owner
        owned = part["owned"]
        np.testing.assert_allclose(part[f"field_{field}"][owned], one[f"field_{field}"][owned], rtol=1e-4,
                                   atol=1e-6, err_msg=field)
      assert list(part["sum_names"]) == list(one["sum_names"])
      np.testing.assert_allclose(part["sums"], one["sums"], rtol=1e-4, atol=1e-6)
      assert list(part["update_names"]) == list(one["update_names"])
      np.testing.assert_allclose(part["update"], one["update"], rtol=1e-4, atol=1e-6)
    assert sum(int(part["owned"].sum()) for part in parts) == 8  # each sample on one process
  changed = [f for f in samples | tokens if not np.allclose(one[f"field_{f}"], 0)]
  assert changed, "the stages wrote only zeros"
  assert one["update"].size == (3 if graph == "ppo" else 0)
