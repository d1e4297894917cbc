"""The benchmark page, written only from one run of the suite: `docs/benchmarks.md` (the CPU's) or
`docs/accelerator.md` (a GPU's or TPU's, its device named), each beside that run's results (`.json`), and the
README's block that points to the CPU page. `tests/test_benchmark_suite.py` fails when a page or the block differs
from what its results give, so every row traces to one run.

  python -m benchmarks.suite --page runs/benchmarks/suite.json    copies the results next to their page and writes it
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- benchmarks-suite:begin -->", "<!-- benchmarks-suite:end -->"
PAGES = {"cpu": ROOT / "docs" / "benchmarks.md"}  # any other backend: docs/accelerator.md
VERDICT_CELLS = {"met": "yes", "not met": "**no**", "report": "", "full size only": "(full size only)"}


def page_path(backend: str) -> Path:
  return PAGES.get(backend, ROOT / "docs" / "accelerator.md")


def show(value) -> str:
  """A figure as the table prints it."""
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    return f"{value + 0.0:.4g}"  # (+ 0.0: a negative zero prints as 0)
  if isinstance(value, (dict, list)):
    return json.dumps(value)
  return str(value)


def counts(suite: dict) -> dict:
  rows = suite["rows"]
  return {"met": sum(r["verdict"] == "met" for r in rows), "not met": sum(r["verdict"] == "not met" and r["figure"] != "(run)" for r in rows),
          "full size only": sum(r["verdict"] == "full size only" for r in rows),
          "reported": sum(r["verdict"] == "report" for r in rows),
          "failed": sum(r["figure"] == "(run)" and not _not_run(r) for r in rows),
          "not run": sum(_not_run(r) for r in rows)}


def _not_run(row: dict) -> bool:
  """A benchmark not run: the run's budget left it no time (`suite.py --budget-s`), it was left out (`--skip`), or it
  needs more accelerator devices than the machine has."""
  return row["figure"] == "(run)" and str(row["value"]).startswith("not run")


def headline(suite: dict) -> str:
  """The run: its command, machine, commit, date and wall time."""
  mode = ("small sizes: figures noisier, and a goal that only the full size defines is reported, not judged"
          if suite["quick"] else "full sizes")
  budget = f" --budget-s {suite['budget_s']:.0f}" if suite.get("budget_s") else ""
  return (f"`python -m benchmarks.suite{' --quick' if suite['quick'] else ''}{budget}` ({mode}) on {suite['device']} (jax "
          f"backend `{suite['backend']}`), commit `{suite['commit']}`, {suite['date']}, "
          f"{suite['wall_s'] / 60:.1f} min of wall time{_speed(suite)}")


def _speed(suite: dict) -> str:
  """The CPU's measured float32 peak and what it made of the benchmarks' time limits (none in older results)."""
  if "f32_gflops" not in suite:
    return ""
  return (f"; its float32 2048-product peak {suite['f32_gflops']:.0f} GFLOP/s, every time limit x "
          f"{suite['slowdown']:.2f}")


def summary(suite: dict) -> str:
  c = counts(suite)
  return (f"{c['met']} goals met, {c['not met']} not met, {c['full size only']} left to a full-size run, "
          f"{c['reported']} figures reported without a goal; {c['failed']} benchmarks failed"
          + (f", {c['not run']} not run (each row says why)" if c["not run"] else ""))


def markdown(suite: dict) -> str:
  """The page: the run, the table, and what each benchmark's figures are measured on."""
  device = "" if suite["backend"] == "cpu" else f" on {suite['device']}"
  lines = [f"# Benchmarks{device}", "",
           "Written by `python -m benchmarks.suite --page RESULTS` from one run of the suite, whose results are beside "
           "this page (same name, `.json`); not edited by hand: a test compares the two.", "",
           headline(suite) + ". Goals and what they are measured on: `benchmarks/goals.toml` at that commit.", "",
           f"**{summary(suite)}.**", "",
           "| benchmark | figure | value | goal | met |", "| --- | --- | --- | --- | --- |"]
  for row in suite["rows"]:
    spread = f" (rounds: {show(row['range'][0])}-{show(row['range'][1])})" if row.get("range") else ""
    lines.append(f"| {row['benchmark']} | `{row['figure']}` | {show(row['value'])}{spread} | {row['goal']} | "
                 f"{'(not run)' if _not_run(row) else VERDICT_CELLS[row['verdict']]} |")
  lines += ["", "## What each figure is measured on", ""]
  for name, about in suite["benchmarks"].items():
    seconds = suite["seconds"].get(name)
    took = f", {seconds:.0f} s in this run" if seconds is not None else ""
    lines += [f"### {name} (issue {about['issue']}{took})", "", f"- Workload: {about['workload']}.",
              f"- Quick run: {about['quick']}.", f"- Process: {about['process']}."]
    lines += [f"- `{figure}`: {what}." for figure, what in about["figures"].items()]
    lines.append("")
  return "\n".join(lines)


def readme_block(suite: dict) -> str:
  page = page_path(suite["backend"]).relative_to(ROOT)
  return (f"{BEGIN}\nFrom one run, {headline(suite)}: **{summary(suite)}**. Every figure, its goal and what it is "
          f"measured on: [{page}]({page}).\n{END}")


def write(results: Path) -> Path:
  """Copies `results` beside its backend's page and writes the page (and, for the CPU, the README's block)."""
  suite = json.loads(Path(results).read_text())
  page = page_path(suite["backend"])
  kept = page.with_suffix(".json")
  if Path(results).resolve() != kept.resolve():
    shutil.copyfile(results, kept)
  page.write_text(markdown(suite))
  if suite["backend"] == "cpu":
    rewrite_readme(suite, README)
  return page


def rewrite_readme(suite: dict, readme: Path = README) -> None:
  """Replaces the README's block between the markers with `readme_block(suite)`."""
  text = readme.read_text()
  if BEGIN not in text or END not in text:
    raise ValueError(f"{readme} has no {BEGIN} ... {END} block to rewrite")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  readme.write_text(head + readme_block(suite) + tail)


def readme_block_in(readme: Path = README) -> str:
  """The README's block as it stands, markers included."""
  text = readme.read_text()
  return BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
