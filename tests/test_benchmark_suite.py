"""`python -m benchmarks.suite`: goals read and checked (each with what it is measured on), rows from a benchmark's
JSON (a quick run judging only what holds at any size), a failing or hanging benchmark as a row (its whole process
group killed), and the benchmark page and README block, which must be those of one run's results."""

import json
import time
from pathlib import Path

import pytest

from benchmarks import page, suite
from benchmarks.goals import Benchmark, Figure, goal_met, load_goals, rows_of
from benchmarks.suite import Bench

ROOT = Path(__file__).resolve().parent.parent


def test_every_benchmark_script_is_in_the_suite_with_goals_that_say_what_they_measure():
  scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__", *suite.HELPERS}
  goals = load_goals()
  assert {b.name for b in suite.BENCHES} == scripts == set(goals)
  for name, bench in goals.items():
    assert bench.workload and bench.process and bench.quick and bench.figures, name
    assert all(f.what for f in bench.figures.values()), name
  from benchmarks.real_model import FULL_ONLY  # what a quick run leaves out is among its goals' figures
  assert {f for figures in FULL_ONLY.values() for f in figures} <= set(goals["real_model"].figures)


ABOUT = 'issue = "22"\nworkload = "w"\nquick = "q"\nprocess = "p"\n'


@pytest.mark.parametrize("text, error", [
    ('[paged]\n' + ABOUT + '[paged.figures]\nx = { goal = "at least 1.5", quick = false, what = "w" }\n',
     r"\[paged\] x = 'at least 1.5'"),
    ('[paged]\n' + ABOUT + '[paged.figures]\nx = ">= 1.5"\n', r"\[paged\] x: expected \{ goal"),
    ('[paged]\nissue = "22"\nquick = "q"\nprocess = "p"\n[paged.figures]\n', r"\[paged\] lacks 'workload'"),
    ('[paged]\n' + ABOUT + '[paged.figures]\nx = { goal = ">= 1", quick = "yes", what = "w" }\n',
     "quick must be true or false"),
    ('[paged]\n' + ABOUT + '[paged.figures]\nx = { goal = ">= 1", quick = true, what = "w", backends = ["gpus"] }\n',
     "backends must be a list of 'cpu', 'gpu', 'tpu'")])
def test_a_goal_that_does_not_read_or_says_not_what_it_measures_is_refused_naming_it(tmp_path, text, error):
  bad = tmp_path / "goals.toml"
  bad.write_text(text)
  with pytest.raises(ValueError, match=error):
    load_goals(bad)


@pytest.mark.parametrize("value, goal, met", [
    (1.5, ">= 1.5", True), (1.49, ">= 1.5", False), (0.15, "<= 0.15", True), (0.1, "< 0.1", False),
    (0, "== 0", True), (1, "== 0", False), (True, "== true", True), (False, "== true", False),
    (True, ">= 1", False), ("not reported", ">= 1", False), (float("nan"), "<= 1", False), (3.0, "report", None),
    (2, "> 1", True)])
def test_goals_are_met_as_written(value, goal, met):
  assert goal_met(value, goal) is met


def spec(**figures) -> Benchmark:
  return Benchmark("1", "w", "q", "p", {k: Figure(goal, quick, "what") for k, (goal, quick) in figures.items()})


def test_rows_follow_dotted_paths_name_what_is_missing_and_judge_a_quick_run_only_where_its_goal_holds():
  result = {"padding_frac": {"stream": 0.01}, "best_vs_tunix": 0.8, "lost": 0}
  goals = spec(**{"padding_frac.stream": ("< 0.05", False), "best_vs_tunix": ("<= 0.75", False),
                  "useful_train_mfu.stream": (">= 0.45", False), "lost": ("== 0", True), "seconds": ("report", False)})
  result["seconds"] = 3.5
  full = rows_of("grpo_step", result, None, goals, quick=False)
  assert [(r["figure"], r["value"], r["verdict"]) for r in full] == [
      ("padding_frac.stream", 0.01, "met"), ("best_vs_tunix", 0.8, "not met"),
      ("useful_train_mfu.stream", "not reported", "not met"), ("lost", 0, "met"), ("seconds", 3.5, "report")]
  quick = rows_of("grpo_step", result, None, goals, quick=True)  # a size-bound goal reported, never judged
  assert [r["verdict"] for r in quick] == ["full size only", "full size only", "not met", "met", "report"]
  omitted = rows_of("real_model", {"quick_omits": ["accuracy_gain"]}, None, spec(accuracy_gain=(">= 0.1", False)),
                    quick=True)
  assert omitted == [dict(benchmark="real_model", figure="accuracy_gain", value="full run only", goal=">= 0.1",
                          verdict="full size only")]
  assert rows_of("paged", None, "timed out after 9 s", goals, quick=False) == [
      dict(benchmark="paged", figure="(run)", value="timed out after 9 s", goal="", verdict="not met")]


def test_a_figure_of_several_rounds_is_judged_on_its_median_and_shown_with_its_range():
  result = {"async_over_trl": 0.58, "async_over_trl_range": [0.55, 0.66]}
  [row] = rows_of("step_profile", result, None, spec(async_over_trl=("<= 0.6", False)), quick=False)
  assert row["verdict"] == "met" and row["range"] == [0.55, 0.66]  # one round above the goal: the median decides
  entry = dict(backend="cpu", device="CPU", commit="abc", date="d", quick=False, wall_s=1.0, seconds={},
               benchmarks={}, rows=[row])
  assert "| step_profile | `async_over_trl` | 0.58 (rounds: 0.55-0.66) | <= 0.6 |" in page.markdown(entry)


def test_a_goal_for_accelerators_is_judged_there_and_reported_elsewhere():
  goals = Benchmark("59", "w", "q", "p", {"decode_vs_roofline": Figure("<= 2", True, "what", ("gpu", "tpu"))})
  verdicts = {backend: rows_of("roofline", {"decode_vs_roofline": 5.9}, None, goals, True, backend)[0]["verdict"]
              for backend in ("cpu", "gpu", "tpu")}
  assert verdicts == {"cpu": "report", "gpu": "not met", "tpu": "not met"}
  assert rows_of("roofline", {"decode_vs_roofline": 1.5}, None, goals, False, "gpu")[0]["verdict"] == "met"
  assert load_goals()["roofline"].figures["decode_vs_roofline"].backends == ("gpu", "tpu")


def test_a_budget_cuts_a_benchmark_short_and_leaves_the_rest_as_rows_that_say_so(tmp_path, monkeypatch):
  hanging = tmp_path / "hanging.py"
  hanging.write_text("import time\ntime.sleep(600)\n")
  result, error, _ = suite.run_bench(Bench("x", 600, 600), True, tmp_path / "x.log", hanging, limit_s=2)
  assert result is None and error == "timed out after 2 s; its last line: no output"  # the budget, not its 600 s
  ran = []
  monkeypatch.setattr(suite, "run_bench", lambda *a, **k: ran.append(a[0].name))
  (tmp_path / "logs").mkdir()
  entry = dict(backend="gpu", seconds={}, benchmarks={}, rows=[])
  suite._run_one(Bench("paged", 600, 600), True, tmp_path, None, {}, entry, log=lambda _: None, left_s=5)
  assert ran == [] and entry["seconds"] == {"paged": 0.0}
  assert entry["rows"][0]["value"].startswith("not run: the suite's --budget-s was spent")
  assert page.counts(entry) == {"met": 0, "not met": 0, "full size only": 0, "reported": 0, "failed": 0, "not run": 1}


def test_a_benchmark_is_run_and_a_failing_or_hanging_one_is_a_row(tmp_path):
  good = tmp_path / "good.py"
  good.write_text('import json, os\nprint("progress")\nprint(json.dumps({"x": 2, "quick": os.environ['
                  '"STREAMRL_BENCH_QUICK"]}))\n')
  failing = tmp_path / "failing.py"
  failing.write_text('import sys\nprint("working", file=sys.stderr)\nraise SystemExit("the model is missing")\n')
  marker = tmp_path / "child.pid"
  hanging = tmp_path / "hanging.py"
  hanging.write_text("import subprocess, sys, time\n"
                     "print('phase: sampling', file=sys.stderr, flush=True)\n"
                     f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                     f"open({str(marker)!r}, 'w').write(str(child.pid))\ntime.sleep(600)\n")
  bench = Bench("x", timeout_s=60, quick_timeout_s=60)
  result, error, _ = suite.run_bench(bench, True, tmp_path / "good.log", good)
  assert (result, error) == ({"x": 2, "quick": "1"}, None)
  result, error, _ = suite.run_bench(bench, False, tmp_path / "failing.log", failing)
  assert result is None and error == "failed (exit 1): the model is missing"
  assert "working" in (tmp_path / "failing.log").read_text()
  slow = Bench("x", timeout_s=2, quick_timeout_s=2)
  result, error, _ = suite.run_bench(slow, False, tmp_path / "hanging.log", hanging, slowdown=1.5)
  assert result is None and error == "timed out after 3 s; its last line: phase: sampling"  # 2 s x 1.5, its phase
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


def results(**overrides) -> dict:
  rows = (rows_of("paged", {"paged_vs_contiguous": 1.2345678}, None, spec(paged_vs_contiguous=(">= 1.5", False)),
                  quick=False)
          + rows_of("wire", None, "timed out after 240 s", None, quick=False))
  return dict(dict(backend="cpu", device="CPU, 2 of 2 cores", commit="abc1234", date="2026-11-26", quick=False,
                   wall_s=125.0, seconds={"paged": 100.0, "wire": 25.0}, rows=rows,
                   benchmarks={"paged": dict(issue="22", workload="the workload", quick="q", process="one process",
                                             figures={"paged_vs_contiguous": "paged over contiguous tokens/s"})}),
              **overrides)


def test_the_page_and_the_readme_block_come_from_one_runs_results(tmp_path):
  suite_json = results()
  text = page.markdown(suite_json)
  assert "| paged | `paged_vs_contiguous` | 1.235 | >= 1.5 | **no** |" in text
  assert "| wire | `(run)` | timed out after 240 s |  | **no** |" in text and "commit `abc1234`" in text
  assert "2.1 min of wall time" in text and "- Workload: the workload." in text
  assert "0 goals met, 1 not met" in text and "1 benchmarks failed" in text
  readme = tmp_path / "README.md"
  readme.write_text(f"# title\n\nbefore\n{page.BEGIN}\nold table\n{page.END}\nafter\n")
  page.rewrite_readme(suite_json, readme)
  assert readme.read_text() == f"# title\n\nbefore\n{page.readme_block(suite_json)}\nafter\n"
  assert "[docs/benchmarks.md](docs/benchmarks.md)" in page.readme_block(suite_json)
  (tmp_path / "other.md").write_text("# no block\n")
  with pytest.raises(ValueError, match="no <!-- benchmarks-suite:begin -->"):
    page.rewrite_readme(suite_json, tmp_path / "other.md")
  assert page.page_path("gpu").name == "accelerator.md"  # an accelerator's run has a page of its own
  assert "# Benchmarks on 1 x H100" in page.markdown(results(backend="gpu", device="1 x H100"))


def test_the_committed_page_and_readme_block_are_one_runs():
  """docs/benchmarks.md and the README's block are exactly what their run's results give: no row edited by hand,
  no row of another run stitched in."""
  results_file = page.page_path("cpu").with_suffix(".json")
  suite_json = json.loads(results_file.read_text())
  assert page.page_path("cpu").read_text() == page.markdown(suite_json), "rewrite it: python -m benchmarks.suite --page"
  assert page.readme_block_in() == page.readme_block(suite_json)
  assert set(suite_json["seconds"]) == {r["benchmark"] for r in suite_json["rows"]} == {b.name for b in suite.BENCHES}
  assert not suite_json["commit"].endswith("-dirty")  # a run of committed code


def test_the_committed_accelerator_page_is_one_runs():
  """docs/accelerator.md is exactly what its run's results (a lent device's, perhaps cut by its budget) give."""
  results_file = page.page_path("gpu").with_suffix(".json")
  suite_json = json.loads(results_file.read_text())
  assert suite_json["backend"] != "cpu"
  assert page.page_path("gpu").read_text() == page.markdown(suite_json), "rewrite it: python -m benchmarks.suite --page"
  assert set(suite_json["seconds"]) == {r["benchmark"] for r in suite_json["rows"]} <= {b.name for b in suite.BENCHES}
  assert not suite_json["commit"].endswith("-dirty") and suite_json["commit"] != "unknown"


def test_only_refuses_an_unknown_benchmark_and_a_page_refuses_a_partial_run(capsys, tmp_path):
  with pytest.raises(SystemExit):
    suite.main(["--only", "nope"])
  assert "--only nope: no such benchmark" in capsys.readouterr().err
  (tmp_path / "suite.json").write_text(json.dumps(results()))  # paged and wire only: an --only run
  with pytest.raises(SystemExit):
    suite.main(["--page", str(tmp_path / "suite.json")])
  assert "a run of every benchmark is needed; this one lacks model_forward" in capsys.readouterr().err


def test_a_benchmark_that_needs_more_devices_or_is_skipped_is_a_row_that_says_why(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr(suite, "run_bench", lambda *a, **k: ran.append(a[0].name) or ({}, None, 1.0))
  monkeypatch.setattr(suite, "machine", lambda: dict(backend="gpu", device="1 x H100", devices=1))
  monkeypatch.setattr(suite, "load_goals", dict)
  benches = [Bench("one", 60, 60), Bench("two", 60, 60, devices=2), Bench("left", 60, 60)]
  result = suite.run_suite(benches, True, tmp_path, log=lambda _: None, skip={"left": "not run: --skip (no weights)"})
  assert ran == ["one"]
  values = {row["benchmark"]: row["value"] for row in result["rows"]}
  assert values == {"two": "not run: needs 2 gpu devices, this machine has 1", "left": "not run: --skip (no weights)"}
  assert page.counts(result)["not run"] == 2 and page.counts(result)["failed"] == 0
  monkeypatch.setattr(suite, "machine", lambda: dict(backend="cpu", device="CPU", devices=1))
  ran.clear()
  suite.run_suite(benches[:2], True, tmp_path, log=lambda _: None)
  assert ran == ["one", "two"]  # a CPU run forces its own host devices
