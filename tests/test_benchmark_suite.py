"""`python -m benchmarks.suite`: goals read and checked, rows from a benchmark's JSON, a failing or hanging
benchmark as a row (its whole process group killed), the table and the README block it rewrites."""

import json
import time
from pathlib import Path

import pytest

from benchmarks import suite
from benchmarks.suite import Bench, goal_met, rows_of

ROOT = Path(__file__).resolve().parent.parent


def test_every_benchmark_script_is_in_the_suite_with_goals():
  scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__", "suite", "sizing"}
  assert {b.name for b in suite.BENCHES} == scripts == set(suite.load_goals())
  assert all(figures for figures in suite.load_goals().values())
  from benchmarks.real_model import FULL_ONLY  # what a quick run leaves out is among its goals' figures
  assert {f for figures in FULL_ONLY.values() for f in figures} <= set(suite.load_goals()["real_model"])


def test_a_goal_that_does_not_read_is_refused_naming_it(tmp_path):
  bad = tmp_path / "goals.toml"
  bad.write_text('[paged]\npaged_vs_contiguous = "at least 1.5"\n')
  with pytest.raises(ValueError, match=r"\[paged\] paged_vs_contiguous = 'at least 1.5'"):
    suite.load_goals(bad)


@pytest.mark.parametrize("value, goal, met", [
    (1.5, ">= 1.5", True), (1.49, ">= 1.5", False), (0.15, "<= 0.15", True), (0.1, "< 0.1", False),
    (0, "== 0", True), (1, "== 0", False), (True, "== true", True), (False, "== true", False),
    (True, ">= 1", False), ("not reported", ">= 1", False), (float("nan"), "<= 1", False), (3.0, "report", None),
    (2, "> 1", True)])
def test_goals_are_met_as_written(value, goal, met):
  assert goal_met(value, goal) is met


def test_rows_follow_dotted_paths_and_name_what_is_missing():
  result = {"padding_frac": {"stream": 0.01}, "best_vs_tunix": 0.8}
  goals = {"padding_frac.stream": "< 0.05", "best_vs_tunix": "<= 0.75", "useful_train_mfu.stream": ">= 0.45"}
  rows = rows_of("grpo_step", result, None, goals)
  assert [(r["figure"], r["value"], r["met"]) for r in rows] == [
      ("padding_frac.stream", 0.01, True), ("best_vs_tunix", 0.8, False),
      ("useful_train_mfu.stream", "not reported", False)]
  omitted = rows_of("real_model", {"quick_omits": ["accuracy_gain"]}, None, {"accuracy_gain": ">= 0.1"})
  assert omitted == [dict(benchmark="real_model", figure="accuracy_gain", value="full run only", goal=">= 0.1",
                          met=None)]
  assert rows_of("paged", None, "timed out after 9 s", goals) == [
      dict(benchmark="paged", figure="(run)", value="timed out after 9 s", goal="", met=False)]


def test_a_benchmark_is_run_and_a_failing_or_hanging_one_is_a_row(tmp_path):
  good = tmp_path / "good.py"
  good.write_text('import json, os\nprint("progress")\nprint(json.dumps({"x": 2, "quick": os.environ['
                  '"STREAMRL_BENCH_QUICK"]}))\n')
  failing = tmp_path / "failing.py"
  failing.write_text('import sys\nprint("working", file=sys.stderr)\nraise SystemExit("the model is missing")\n')
  marker = tmp_path / "child.pid"
  hanging = tmp_path / "hanging.py"
  hanging.write_text("import subprocess, sys, time\n"
                     f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                     f"open({str(marker)!r}, 'w').write(str(child.pid))\ntime.sleep(600)\n")
  bench = Bench("x", timeout_s=60, quick_timeout_s=60)
  result, error, _ = suite.run_bench(bench, True, tmp_path / "good.log", good)
  assert (result, error) == ({"x": 2, "quick": "1"}, None)
  result, error, _ = suite.run_bench(bench, False, tmp_path / "failing.log", failing)
  assert result is None and error == "failed (exit 1): the model is missing"
  assert "working" in (tmp_path / "failing.log").read_text()
  slow = Bench("x", timeout_s=3, quick_timeout_s=3)
  result, error, _ = suite.run_bench(slow, False, tmp_path / "hanging.log", hanging)
  assert result is None and error == "timed out after 3 s"
  child = int(marker.read_text())  # the benchmark's own child went with it (the process group)
  deadline = time.monotonic() + 10
  while alive(child) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not alive(child), f"the hanging benchmark's child {child} is still alive"


def alive(pid: int) -> bool:
  """Whether a process runs (a zombie waiting for its parent to reap it does not)."""
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_the_table_and_the_readme_block_come_from_suite_json(tmp_path):
  results = dict(backend="cpu", device="CPU, 2 of 2 cores", commit="abc1234", date="2026-11-26", quick=True,
                 rows=rows_of("paged", {"paged_vs_contiguous": 1.2345678}, None, {"paged_vs_contiguous": ">= 1.5"})
                 + rows_of("wire", None, "timed out after 240 s", {}))
  (tmp_path / "suite.json").write_text(json.dumps(results))
  table = suite.markdown(results)
  assert "| paged | `paged_vs_contiguous` | 1.235 | >= 1.5 | **no** |" in table
  assert "| wire | `(run)` | timed out after 240 s |  | **no** |" in table and "commit `abc1234`" in table
  readme = tmp_path / "README.md"
  readme.write_text(f"# title\n\nbefore\n{suite.BEGIN}\nold table\n{suite.END}\nafter\n")
  suite.rewrite_readme(tmp_path / "suite.json", readme)
  assert readme.read_text() == f"# title\n\nbefore\n{suite.BEGIN}\n{table}{suite.END}\nafter\n"
  with pytest.raises(ValueError, match="no <!-- benchmarks-suite:begin -->"):
    suite.rewrite_readme(tmp_path / "suite.json", tmp_path / "suite.json")
  assert suite.BEGIN in (ROOT / "README.md").read_text()  # the project's README has the block


def test_only_refuses_an_unknown_benchmark(capsys):
  with pytest.raises(SystemExit):
    suite.main(["--only", "nope"])
  assert "--only nope: no such benchmark" in capsys.readouterr().err
