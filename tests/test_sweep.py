"""The flake sweep (tests/sweep.py): CI runs the riskiest thread tests twice in a row; and the sweep itself
finds the thread tests of a file and counts a failure in every round it happens."""

import json
import subprocess
import sys

import pytest

from tests import sweep

ROOT = sweep.ROOT


@pytest.mark.slow
def test_the_riskiest_thread_tests_pass_two_rounds_in_a_row():
  done = subprocess.run([sys.executable, "-m", "tests.sweep", "--count", "2", "--riskiest"], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  result = json.loads(done.stdout.strip().splitlines()[-1])
  named = "\n".join(f"{node} failed in {n} round(s):\n{result['errors'][node]}"
                    for node, n in result["failures"].items())
  assert done.returncode == 0 and result["failures"] == {} and result["rounds"] == 2, named or done.stderr[-3000:]


def test_the_sweep_takes_only_thread_tests_and_counts_each_failing_round(tmp_path):
  (tmp_path / "test_mixed.py").write_text(
      "import threading\n\n"
      "def test_plain():\n  assert True\n\n"
      "def test_threaded():\n  t = threading.Thread(target=lambda: None)\n  t.start()\n  t.join()\n\n"
      "def test_threaded_and_failing():\n  t = threading.Thread(target=lambda: None)\n  t.start()\n  t.join()\n"
      "  assert 1 + 1 == 3, 'the sum is off'\n")
  (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())  # the recorder
  result = sweep.sweep([str(tmp_path / "test_mixed.py")], count=3)
  failing = f"{tmp_path}/test_mixed.py::test_threaded_and_failing"
  assert result["tests"] == 2 and result["failures"] == {failing: 3}
  assert list(result["errors"]) == [failing] and "AssertionError: the sum is off" in result["errors"][failing]
  assert result["errors"][failing].startswith("[call] ")
