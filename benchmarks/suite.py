"""Every benchmark in its own process, each headline figure against its goal, in one table.

  python -m benchmarks.suite [--quick] [--only NAME ...] [--budget-s SECONDS] [--out DIR]
  python -m benchmarks.suite --page DIR/suite.json     the benchmark page (and README block) from one run's results

Writes DIR/suite.json ({"backend", "device", "commit", "date", "quick", "wall_s", "seconds", "benchmarks": what
each is measured on, "rows": [{"benchmark", "figure", "value", "goal", "verdict"}, ...]}), DIR/suite.md (the page)
and DIR/logs/NAME.log (each benchmark's output). The figures, their goals and what they are measured on are
`benchmarks/goals.toml` (`benchmarks/goals.py`). A benchmark that fails or runs past its time is a row that says so,
and the suite goes on. `--quick` runs each benchmark at its small sizes (`benchmarks/sizing.py`): every figure, in
minutes on a 2-core CPU, noisier, and only the goals that hold at any size judged. Prints one JSON object (the
counts) as its last line. `--page` (`benchmarks/page.py`) writes docs/benchmarks.md (docs/accelerator.md for a GPU
or TPU run) with that run's results beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import page
from benchmarks.goals import load_goals, rows_of

ROOT = Path(__file__).resolve().parent.parent
MIN_START_S = 20  # with --budget-s, a benchmark left less than this is not started
# The float32 2048-product peak (GFLOP/s, one device, every core) of the machine the time limits below were set on (a
# 2-core Xeon with AVX-512); on a slower machine every limit grows by this over its own measured peak
LIMITS_SET_AT_GFLOPS = 300.0
HELPERS = ("suite", "sizing", "goals", "page", "peak", "process_memory",  # modules of benchmarks/ that are no benchmark
           "trl_grpo",  # (step_profile runs TRL through it)
           "trainer_memory",  # (real_model runs the trainer's memory variants through it)
           "workflow_costs")  # (pipeline runs the step graph's costs through it)


@dataclasses.dataclass(frozen=True)
class Bench:
  """One benchmark script: its arguments and time limit, full and quick."""

  name: str
  timeout_s: float
  quick_timeout_s: float
  args: tuple[str, ...] = ()
  quick_args: tuple[str, ...] = ()
  shared_cache: bool = True  # a quick run compiles through the suite's XLA cache (off where compiles are measured)
  devices: int = 1  # accelerator devices it needs (two meshes: 2); a CPU run forces its own host devices


# In the order they run: the quick and fundamental first.
BENCHES = (
    Bench("model_forward", 600, 120),
    Bench("roofline", 600, 180),
    Bench("simulator", 600, 120),
    Bench("sampler", 1200, 180),
    Bench("trainer", 1200, 180),
    Bench("scheduling", 1200, 180, devices=4),
    Bench("paged", 1800, 180),
    Bench("grpo_step", 1800, 240, devices=2),
    Bench("pipeline", 3600, 900, devices=2),  # the four modes, then the step graph's costs (workflow_costs)
    Bench("pipeline_scheduling", 1800, 180, devices=2),
    Bench("multiprocess", 1800, 240, devices=2),
    Bench("distributed", 1800, 600, devices=4),
    Bench("inflight", 2400, 240),
    Bench("precision", 1800, 240),
    Bench("multiturn", 1800, 240, devices=2),
    Bench("rewards", 3600, 180, (), ("--part", "throughput"), devices=2),
    Bench("faults", 1200, 240, devices=2),
    # rss_growth_frac compares a clean and a fuzzed trainer's peaks
    Bench("wire", 1200, 240, shared_cache=False, devices=2),
    Bench("broadcast", 900, 180),
    Bench("real_model", 6000, 420),
    Bench("lora", 3600, 420),
    Bench("serve", 1200, 420),
    Bench("arms", 1800, 420, devices=4),
    Bench("step_profile", 1800, 300),
    Bench("async_learning", 4800, 600),  # three SmolLM2 runs of 15 steps (quick: the demo's, 4 steps)
    Bench("families", 2400, 420, shared_cache=False),  # its first step's seconds hold the compiles
)


def run_bench(bench: Bench, quick: bool, log_path: Path, script: Path | None = None, cache: Path | None = None,
              limit_s: float | None = None, slowdown: float = 1.0) -> tuple[dict | None, str | None, float]:
  """(its JSON, None) or (None, why it has none), and its seconds; output to `log_path`, the whole process group
  killed when it runs past its time times `slowdown` (this machine's speed against the one the limits were set on;
  or `limit_s`, when shorter), saying what it printed last (the phase it was in). `script`: the file run (default
  benchmarks/NAME.py). `cache`: an XLA
  compilation cache directory its processes share (a quick run's: the many processes and arms of one benchmark
  compile the same programs; figures are steady-state, never a compile)."""
  script = script or ROOT / "benchmarks" / f"{bench.name}.py"
  command = [sys.executable, str(script), *(bench.quick_args if quick else bench.args)]
  env = dict(os.environ, STREAMRL_BENCH_QUICK="1" if quick else "0")
  if cache is not None and bench.shared_cache:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  timeout = min((bench.quick_timeout_s if quick else bench.timeout_s) * slowdown, limit_s or float("inf"))
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
      log.flush()
      last = _last_error(log_path)
      return None, f"timed out after {timeout:.0f} s; its last line: {last}", time.perf_counter() - start
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
  """backend and device of this machine's jax, and on a CPU its float32 2048-product peak and the `slowdown` every
  time limit is multiplied by (asked in a process of its own: this one never holds a device)."""
  probe = ("import jax; from benchmarks.peak import matmul_peak_flops; d = jax.devices()[0]; "
           "cpu = jax.default_backend() == 'cpu'; "
           "print(jax.default_backend(), '|', d.device_kind, '|', len(jax.devices()), '|', "
           "matmul_peak_flops() / 1e9 if cpu else 0)")
  try:
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True,
                         cwd=ROOT)
    backend, kind, count, gflops = (part.strip() for part in out.stdout.strip().splitlines()[-1].split("|"))
  except (subprocess.SubprocessError, ValueError, IndexError) as err:
    return dict(backend="unknown", device=f"unknown ({err})", devices=1, slowdown=1.0)
  cores = os.cpu_count()
  device = f"{count} x {kind}" if backend != "cpu" else f"CPU, {len(os.sched_getaffinity(0))} of {cores} cores"
  speed = dict(f32_gflops=round(float(gflops), 1),
               slowdown=round(max(1.0, LIMITS_SET_AT_GFLOPS / float(gflops)), 2)) if backend == "cpu" else {}
  return dict(backend=backend, device=device, devices=int(count), **({"slowdown": 1.0} | speed))


def commit() -> str:
  """The commit this run measures (`-dirty` when the tree holds uncommitted changes); $STREAMRL_COMMIT where the
  tree travelled without its .git (a lent device's copy of a committed tree)."""
  if os.environ.get("STREAMRL_COMMIT"):
    return os.environ["STREAMRL_COMMIT"]
  try:
    return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (subprocess.SubprocessError, OSError):
    return "unknown"


def run_suite(benches, quick: bool, out: Path, log=print, budget_s: float | None = None,
              skip: dict[str, str] | None = None) -> dict:
  """Runs `benches` one after another; returns (and writes) the suite's results. With `budget_s` (a lent
  accelerator's minutes) no benchmark runs past the budget, and one left less than MIN_START_S is a row saying so.
  `skip`: benchmarks left out, each a row with its reason; so is one that needs more accelerator devices than
  the machine has."""
  goals = load_goals()
  out.mkdir(parents=True, exist_ok=True)
  (out / "logs").mkdir(exist_ok=True)
  suite = dict(**machine(), commit=commit(), date=datetime.date.today().isoformat(), quick=quick, budget_s=budget_s,
               wall_s=0.0,
               seconds={}, benchmarks={}, rows=[])
  cache = Path(tempfile.mkdtemp(prefix="xla-cache-", dir=out)) if quick else None  # fresh: a cold start's figures
  start = time.perf_counter()
  try:
    for bench in benches:
      left = None if budget_s is None else budget_s - (time.perf_counter() - start)
      why = (skip or {}).get(bench.name) or _too_few_devices(bench, suite)
      _run_one(bench, quick, out, cache, goals, suite, log, left, why)
      suite["wall_s"] = round(time.perf_counter() - start, 1)
      _write(out, suite)  # after each one: nothing lost to a stop
  finally:
    if cache is not None:
      shutil.rmtree(cache, ignore_errors=True)
  return suite


def _write(out: Path, suite: dict) -> None:
  (out / "suite.json").write_text(json.dumps(suite, indent=1))
  (out / "suite.md").write_text(page.markdown(suite))


def _too_few_devices(bench: Bench, suite: dict) -> str | None:
  if suite["backend"] == "cpu" or bench.devices <= suite.get("devices", 1):
    return None
  return f"not run: needs {bench.devices} {suite['backend']} devices, this machine has {suite.get('devices', 1)}"


def _run_one(bench: Bench, quick: bool, out: Path, cache: Path | None, goals: dict, suite: dict, log,
             left_s: float | None = None, skipped: str | None = None) -> None:
  """One benchmark: its rows added to `suite`, its line logged, the results written. `left_s`: the run's budget left
  (None: no budget); `skipped`: why it is not run (None: it runs)."""
  if skipped:
    result, error, seconds = None, skipped, 0.0
  elif left_s is not None and left_s < MIN_START_S:
    result, error, seconds = None, f"not run: the suite's --budget-s was spent ({left_s:.0f} s left)", 0.0
  else:
    log(f"[suite] {bench.name}: running{' (quick)' if quick else ''} ...")
    result, error, seconds = run_bench(bench, quick, out / "logs" / f"{bench.name}.log", cache=cache, limit_s=left_s,
                                       slowdown=suite.get("slowdown", 1.0))
  suite["seconds"][bench.name] = round(seconds, 1)
  spec = goals.get(bench.name)
  if spec is not None:  # what this run's figures are measured on, as goals.toml said at its start
    suite["benchmarks"][bench.name] = dict(spec.about(), figures={k: f.what for k, f in spec.figures.items()})
  rows = rows_of(bench.name, result, error, spec, quick, suite["backend"])
  suite["rows"] += rows
  said = error or ", ".join(f"{r['figure']}={page.show(r['value'])}" for r in rows)
  log(f"[suite] {bench.name}: {seconds:.0f} s; {said}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="each benchmark at its small sizes (minutes on a CPU)")
  parser.add_argument("--only", action="append", default=[], metavar="NAME",
                      help=f"run only this benchmark (repeatable): {', '.join(b.name for b in BENCHES)}")
  parser.add_argument("--budget-s", type=float, metavar="SECONDS",
                      help="the whole run's wall limit (a lent device's minutes): no benchmark runs past it, and those "
                           "it leaves no time for are rows that say so")
  parser.add_argument("--skip", action="append", default=[], metavar="NAME=REASON",
                      help="leave a benchmark out, a row saying why (e.g. real_model='no registry to fetch SmolLM2')")
  parser.add_argument("--out", default="runs/benchmarks", help="where suite.json, suite.md and logs/ go")
  parser.add_argument("--page", metavar="SUITE_JSON",
                      help="write the benchmark page (docs/benchmarks.md, or docs/accelerator.md for a GPU or TPU "
                           "run) and the README's block from one run's suite.json, instead of running anything")
  args = parser.parse_args(argv)
  if args.page:
    ran = set(json.loads(Path(args.page).read_text())["seconds"])
    missing = [b.name for b in BENCHES if b.name not in ran]
    if missing:  # a page is one whole run: every benchmark, each once
      parser.error(f"--page {args.page}: a run of every benchmark is needed; this one lacks {', '.join(missing)}")
    written = page.write(Path(args.page))
    print(json.dumps({"page": str(written.relative_to(ROOT)), "from": args.page}))
    return 0
  known = {b.name for b in BENCHES}
  skip = dict(item.partition("=")[::2] for item in args.skip)
  for flag, names in (("--only", args.only), ("--skip", skip)):
    unknown = sorted(set(names) - known)
    if unknown:
      parser.error(f"{flag} {unknown[0]}: no such benchmark; known: {', '.join(sorted(known))}")
  benches = [b for b in BENCHES if not args.only or b.name in args.only]
  skip = {name: f"not run: --skip ({why or 'no reason given'})" for name, why in skip.items()}
  suite = run_suite(benches, args.quick, Path(args.out), log=lambda text: print(text, file=sys.stderr, flush=True),
                    budget_s=args.budget_s, skip=skip)
  print(json.dumps(dict(out=args.out, rows=len(suite["rows"]), **{k.replace(" ", "_"): v for k, v in
                                                                  page.counts(suite).items()},
                        wall_s=suite["wall_s"])))
  return 0


if __name__ == "__main__":
  sys.exit(main())
