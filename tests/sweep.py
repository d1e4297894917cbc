"""The flake sweep: every test that starts a thread or a process, run N times, each round a fresh pytest process.

  python -m tests.sweep --count 10                 every thread/process test of the suite, 10 rounds
  python -m tests.sweep --count 3 --riskiest       the tests in RISKIEST (what CI runs, through tests/test_sweep.py)
  python -m tests.sweep --count 5 tests/test_flight.py   the thread/process tests among these paths

Which tests start threads or processes is not a list kept by hand: the first round runs the selection with a
recorder (STREAMRL_SWEEP_RECORD) that notes every test whose set-up or body starts a `threading.Thread` or a
`subprocess.Popen`, and the later rounds run exactly those. Prints one line per round (and each test that failed in
it) and, last, one JSON object: {"rounds", "tests", "failures": {node id: rounds it failed}, "errors": {node id: the
last lines of its last failure}, "seconds"}; exits 1 if any test failed in any round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD_ENV, FAILED_ENV = "STREAMRL_SWEEP_RECORD", "STREAMRL_SWEEP_FAILED"  # read by tests/conftest.py
SELF = "tests/test_sweep.py"
# The thread tests that order threads by events and fault points (once by sleeps) and finish in seconds: CI runs
# them three times. The process chaos tests take minutes a round; the full sweep covers them.
RISKIEST = (
    "tests/test_flight.py::test_a_full_queue_makes_the_sender_wait_and_nothing_is_lost",
    "tests/test_broadcast.py::test_a_child_fetches_through_a_relay_while_the_relay_receives",
    "tests/test_broadcast.py::test_a_relay_that_fails_mid_transfer_sends_its_child_to_the_trainer",
    "tests/test_broadcast.py::test_a_relay_whose_source_fails_fetches_again_and_its_children_go_on",
    "tests/test_faults.py::test_a_late_watchdog_tick_blames_this_process_not_the_samplers",
    "tests/test_faults.py::test_a_long_poll_waiting_in_the_controller_does_not_keep_a_silent_sampler_alive",
    "tests/test_launch.py::test_a_launcher_holds_each_device_once_in_order_and_only_its_own",
    "tests/test_launch.py::test_two_threads_launching_collectives_through_the_launcher_finish",
    "tests/test_streaming.py",
    "tests/test_arm_feed.py",
)


def _pytest(args: list[str], record: Path | None = None) -> tuple[int, dict[str, str]]:
  """One pytest process over `args` (the sweep's own tests left out: they run sweeps of their own); (exit code,
  {node id that failed: its error's last lines}). Only this pytest writes to `record` and to its failures file:
  nothing of a sweep this one runs inside (its environment's) reaches them."""
  with tempfile.NamedTemporaryFile("r", suffix=".txt") as failed:
    env = {k: v for k, v in os.environ.items() if k not in (RECORD_ENV, FAILED_ENV)}
    env.update({FAILED_ENV: failed.name, **({RECORD_ENV: str(record)} if record else {})})
    # "-n 0": in this one process (the project's pytest options may spread tests over worker processes)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args,
                           "--deselect", SELF], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    print(lines[-1] if lines else f"pytest exited {done.returncode}", file=sys.stderr, flush=True)
    failures = _failures(Path(failed.name))
    for node in failures:
      print(f"[sweep]   failed: {_short(node)}", file=sys.stderr, flush=True)
    return done.returncode, failures


def _ids(path: Path) -> list[str]:
  """The node ids a recorder or reporter wrote, one a line (an id may hold spaces: a test's parameters)."""
  return sorted({line for line in path.read_text().splitlines() if line.strip()})


def _failures(path: Path) -> dict[str, str]:
  """{node id: error} of the reporter's JSON lines (tests/conftest.py); a test failing in set-up and teardown both
  keeps both errors."""
  out: dict[str, str] = {}
  for line in path.read_text().splitlines():
    if line.strip():
      row = json.loads(line)
      out[row["test"]] = "\n".join(filter(None, (out.get(row["test"]), f"[{row['when']}] {row['error']}")))
  return out


def _short(node: str) -> str:
  """A node id relative to the repository's root when it is under it."""
  return node[len(str(ROOT)) + 1:] if node.startswith(str(ROOT) + os.sep) else node


def sweep(selection: list[str], count: int, record_first: bool = True) -> dict:
  """`count` rounds over the thread/process tests of `selection` (all of it with `record_first=False`)."""
  start, failures, errors = time.monotonic(), {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    record = Path(tmp) / "concurrent.txt"
    record.touch()
    code, failed = _pytest(selection, record if record_first else None)
    if code not in (0, 1):  # 1: tests failed (counted); anything else: pytest could not run them
      raise RuntimeError(f"pytest exited {code} on {selection}")
    tests = _ids(record) if record_first else selection
  _count(failed, failures, errors)
  for round_ in range(2, count + 1):
    print(f"[sweep] round {round_}/{count}: {len(tests)} tests", file=sys.stderr, flush=True)
    if not tests:
      break
    code, failed = _pytest(tests)
    if code not in (0, 1):
      raise RuntimeError(f"pytest exited {code} in round {round_}")
    _count(failed, failures, errors)
  return dict(rounds=count, tests=len(tests), failures=failures, errors=errors,
              seconds=round(time.monotonic() - start))


def _count(failed: dict[str, str], failures: dict[str, int], errors: dict[str, str]) -> None:
  """A round's failures into the sweep's tallies: one more round for each, its error the latest."""
  for node, error in failed.items():
    failures[_short(node)] = failures.get(_short(node), 0) + 1
    errors[_short(node)] = error


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tests.sweep", description=__doc__.splitlines()[0])
  parser.add_argument("--count", type=int, default=10, help="rounds (default 10)")
  parser.add_argument("--riskiest", action="store_true", help="the tests in RISKIEST, not the whole suite's")
  parser.add_argument("paths", nargs="*", help="test paths or node ids to take the thread/process tests of")
  args = parser.parse_args(argv)
  if args.count < 1:
    parser.error("--count must be >= 1")
  result = sweep(list(RISKIEST) if args.riskiest else args.paths or ["tests"], args.count,
                 record_first=not args.riskiest)
  print(json.dumps(result))
  return 1 if result["failures"] else 0


if __name__ == "__main__":
  sys.exit(main())
