"""Every benchmark in its own process, each headline figure against its goal, in one table.

  python -m benchmarks.suite [--quick] [--only NAME ...] [--out DIR]
  python -m benchmarks.suite --readme DIR/suite.json     rewrites the README's table from a suite's results

Writes DIR/suite.json ({"backend", "device", "commit", "date", "quick", "rows": [{"benchmark", "figure", "value",
"goal", "met"}, ...]}), DIR/suite.md (the same as a table) and DIR/logs/NAME.log (each benchmark's output). The
figures and their goals are `benchmarks/goals.toml`. A benchmark that fails or runs past its time is a row that
says so, and the suite goes on. `--quick` runs each benchmark at its small sizes (`benchmarks/sizing.py`): every
figure, in minutes on a 2-core CPU, noisier. Prints one JSON object (the counts) as its last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOALS = Path(__file__).resolve().parent / "goals.toml"
README = ROOT / "README.md"
BEGIN, END = "<!-- benchmarks-suite:begin -->", "<!-- benchmarks-suite:end -->"
GOAL = re.compile(r"^(>=|<=|==|<|>)\s*(\S+)$")


@dataclasses.dataclass(frozen=True)
class Bench:
  """One benchmark script: its arguments and time limit, full and quick."""

  name: str
  timeout_s: float
  quick_timeout_s: float
  args: tuple[str, ...] = ()
  quick_args: tuple[str, ...] = ()
  shared_cache: bool = True  # a quick run compiles through the suite's XLA cache (off where compiles are measured)


# In the order they run: the quick and fundamental first.
BENCHES = (
    Bench("model_forward", 600, 120),
    Bench("simulator", 600, 120),
    Bench("sampler", 1200, 180),
    Bench("trainer", 1200, 180),
    Bench("scheduling", 1200, 180),
    Bench("paged", 1800, 180),
    Bench("grpo_step", 1800, 240),
    Bench("pipeline", 1800, 180),
    Bench("pipeline_scheduling", 1800, 180),
    Bench("multiprocess", 1800, 240),
    Bench("inflight", 2400, 240),
    Bench("precision", 1800, 240),
    Bench("multiturn", 1800, 240),
    Bench("rewards", 3600, 180, (), ("--part", "throughput")),
    Bench("faults", 1200, 240),
    Bench("wire", 1200, 240, shared_cache=False),  # rss_growth_frac compares a clean and a fuzzed trainer's peaks
    Bench("broadcast", 900, 180),
    Bench("real_model", 6000, 420),
    Bench("lora", 3600, 420),
    Bench("serve", 1200, 420),
    Bench("arms", 1800, 420),
)


def load_goals(path: Path = GOALS) -> dict[str, dict[str, str]]:
  """{benchmark: {figure path: goal}}; a goal that does not read is an error naming it."""
  goals = tomllib.loads(path.read_text())
  for bench, figures in goals.items():
    for figure, goal in figures.items():
      if goal != "report" and not GOAL.match(goal):
        raise ValueError(f"{path}: [{bench}] {figure} = {goal!r}: expected 'report' or an op (>=, <=, ==, <, >) "
                         "and a number, true or false")
  return goals


def figure_value(result: dict, path: str):
  """The value at a dotted path of a benchmark's JSON, or KeyError naming the missing step."""
  value = result
  for part in path.split("."):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(part)
    value = value[part]
  return value


def goal_met(value, goal: str) -> bool | None:
  """Whether `value` meets `goal` (None for "report"); a value that is not a number or boolean does not."""
  if goal == "report":
    return None
  op, want = GOAL.match(goal).groups()
  if want in ("true", "false"):
    return isinstance(value, bool) and (value == (want == "true")) == (op == "==")
  if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
    return False
  want = float(want)
  return {">=": value >= want, "<=": value <= want, "==": value == want, "<": value < want, ">": value > want}[op]


def rows_of(bench: str, result: dict | None, error: str | None, goals: dict[str, str]) -> list[dict]:
  """The table's rows of one benchmark: each goal's figure, or one row saying why there are none. A figure the
  benchmark names in `quick_omits` (parts too long for a quick run) is a row saying so, with no verdict."""
  if result is None:
    return [dict(benchmark=bench, figure="(run)", value=error, goal="", met=False)]
  rows = []
  for figure, goal in goals.items():
    if figure in result.get("quick_omits", ()):
      rows.append(dict(benchmark=bench, figure=figure, value="full run only", goal=goal, met=None))
      continue
    try:
      value = figure_value(result, figure)
    except KeyError:
      value = "not reported"
    rows.append(dict(benchmark=bench, figure=figure, value=value, goal=goal, met=goal_met(value, goal)))
  return rows


def run_bench(bench: Bench, quick: bool, log_path: Path, script: Path | None = None, cache: Path | None = None
              ) -> tuple[dict | None, str | None, float]:
  """(its JSON, None) or (None, why it has none), and its seconds; output to `log_path`, the whole process group
  killed when it runs past its time. `script`: the file run (default benchmarks/NAME.py). `cache`: an XLA
  compilation cache directory its processes share (a quick run's: the many processes and arms of one benchmark
  compile the same programs; figures are steady-state, never a compile)."""
  script = script or ROOT / "benchmarks" / f"{bench.name}.py"
  command = [sys.executable, str(script), *(bench.quick_args if quick else bench.args)]
  env = dict(os.environ, STREAMRL_BENCH_QUICK="1" if quick else "0")
  if cache is not None and bench.shared_cache:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  timeout = bench.quick_timeout_s if quick else bench.timeout_s
  start = time.perf_counter()
  with log_path.open("w") as log:
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    try:
      out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, _ = proc.communicate()
      log.write(out)
      return None, f"timed out after {timeout:.0f} s", time.perf_counter() - start
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    log.write(out)
  seconds = time.perf_counter() - start
  lines = [line for line in out.splitlines() if line.strip()]
  if proc.returncode != 0:
    return None, f"failed (exit {proc.returncode}): {_last_error(log_path)}", seconds
  try:
    result = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    return None, "printed no JSON object as its last line", seconds
  return (result, None, seconds) if isinstance(result, dict) else (None, "its last line is not an object", seconds)


def _last_error(log_path: Path) -> str:
  lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
  return lines[-1][:200] if lines else "no output"


def machine() -> dict:
  """backend and device of this machine's jax (asked in a process of its own: this one never holds a device)."""
  probe = "import jax; d = jax.devices()[0]; print(jax.default_backend(), '|', d.device_kind, '|', len(jax.devices()))"
  try:
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    backend, kind, count = (part.strip() for part in out.stdout.strip().splitlines()[-1].split("|"))
  except (subprocess.SubprocessError, ValueError, IndexError) as err:
    return dict(backend="unknown", device=f"unknown ({err})")
  cores = os.cpu_count()
  device = f"{count} x {kind}" if backend != "cpu" else f"CPU, {len(os.sched_getaffinity(0))} of {cores} cores"
  return dict(backend=backend, device=device)


def commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (subprocess.SubprocessError, OSError):
    return "unknown"


def show(value) -> str:
  """A figure as the table prints it."""
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    return f"{value + 0.0:.4g}"  # (+ 0.0: a negative zero prints as 0)
  if isinstance(value, (dict, list)):
    return json.dumps(value)
  return str(value)


def markdown(suite: dict) -> str:
  """The suite as a Markdown table, with the machine, commit and date above it."""
  mode = "small sizes, figures noisier" if suite["quick"] else "full sizes"
  seconds = suite.get("seconds") or {}
  took = f", {sum(seconds.values()) / 60:.0f} min in all" if seconds else ""
  lines = [f"`python -m benchmarks.suite{' --quick' if suite['quick'] else ''}` ({mode}{took}) on {suite['device']} "
           f"(jax backend `{suite['backend']}`), commit `{suite['commit']}`, {suite['date']}; goals from "
           "`benchmarks/goals.toml`.", "", "| benchmark | figure | value | goal | met |", "| --- | --- | --- | --- | --- |"]
  for row in suite["rows"]:
    met = {True: "yes", False: "**no**", None: ""}[row["met"]]
    lines.append(f"| {row['benchmark']} | `{row['figure']}` | {show(row['value'])} | {row['goal']} | {met} |")
  return "\n".join(lines) + "\n"


def rewrite_readme(suite_json: Path, readme: Path = README) -> None:
  """Replaces the README's block between the suite's markers with the table of `suite_json`."""
  text = readme.read_text()
  if BEGIN not in text or END not in text:
    raise ValueError(f"{readme} has no {BEGIN} ... {END} block to rewrite")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  table = markdown(json.loads(suite_json.read_text()))
  readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def run_suite(benches, quick: bool, out: Path, log=print) -> dict:
  """Runs `benches` one after another; returns (and writes) the suite's results."""
  goals = load_goals()
  out.mkdir(parents=True, exist_ok=True)
  (out / "logs").mkdir(exist_ok=True)
  suite = dict(**machine(), commit=commit(), date=datetime.date.today().isoformat(), quick=quick, rows=[],
               seconds={})
  cache = Path(tempfile.mkdtemp(prefix="xla-cache-", dir=out)) if quick else None  # fresh: a cold start's figures
  try:
    for bench in benches:
      _run_one(bench, quick, out, cache, goals, suite, log)
  finally:
    if cache is not None:
      shutil.rmtree(cache, ignore_errors=True)
  return suite


def _run_one(bench: Bench, quick: bool, out: Path, cache: Path | None, goals: dict, suite: dict, log) -> None:
  """One benchmark: its rows added to `suite`, its line logged, the results written."""
  log(f"[suite] {bench.name}: running{' (quick)' if quick else ''} ...")
  result, error, seconds = run_bench(bench, quick, out / "logs" / f"{bench.name}.log", cache=cache)
  suite["seconds"][bench.name] = round(seconds, 1)
  rows = rows_of(bench.name, result, error, goals.get(bench.name, {}))
  suite["rows"] += rows
  said = error or ", ".join(f"{r['figure']}={show(r['value'])}" for r in rows)
  log(f"[suite] {bench.name}: {seconds:.0f} s; {said}")
  (out / "suite.json").write_text(json.dumps(suite, indent=1))  # kept after each one: nothing lost to a stop
  (out / "suite.md").write_text(markdown(suite))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="each benchmark at its small sizes (minutes on a CPU)")
  parser.add_argument("--only", action="append", default=[], metavar="NAME",
                      help=f"run only this benchmark (repeatable): {', '.join(b.name for b in BENCHES)}")
  parser.add_argument("--out", default="runs/benchmarks", help="where suite.json, suite.md and logs/ go")
  parser.add_argument("--readme", metavar="SUITE_JSON",
                      help="rewrite the README's table from this suite.json instead of running anything")
  args = parser.parse_args(argv)
  if args.readme:
    rewrite_readme(Path(args.readme))
    print(json.dumps({"readme": str(README), "from": args.readme}))
    return 0
  known = {b.name for b in BENCHES}
  unknown = sorted(set(args.only) - known)
  if unknown:
    parser.error(f"--only {unknown[0]}: no such benchmark; known: {', '.join(sorted(known))}")
  benches = [b for b in BENCHES if not args.only or b.name in args.only]
  suite = run_suite(benches, args.quick, Path(args.out), log=lambda text: print(text, file=sys.stderr, flush=True))
  rows = suite["rows"]
  print(json.dumps(dict(out=args.out, rows=len(rows), met=sum(r["met"] is True for r in rows),
                        not_met=sum(r["met"] is False for r in rows), reported=sum(r["met"] is None for r in rows),
                        failed=sum(r["figure"] == "(run)" for r in rows), seconds=round(sum(suite["seconds"].values())))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
