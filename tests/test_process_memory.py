"""The benchmarks' memory sampler: a run's peak summed over its process tree, and which process held what then."""

import select
import subprocess
import sys
import time

from benchmarks.process_memory import TreeSampler

HOLD_MB = 256
# a child that holds HOLD_MB of touched pages in a grandchild of its own, says so, and waits for its stdin to close
HOLDER = f"""
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; b = b'x' * ({HOLD_MB} * 2**20); "
                               "print('held', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
assert grandchild.stdout.readline().strip() == "held"
print("ready", flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def _line(proc, timeout_s: float) -> str:
  ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
  assert ready, f"no line from the child within {timeout_s} s"
  return proc.stdout.readline().strip()


def test_the_peak_names_the_process_that_held_the_memory_in_a_descendant():
  child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert _line(child, 60) == "ready"
    sampler = TreeSampler(child.pid, period=0.05).start()
    deadline = time.monotonic() + 60
    while sampler.samples < 3 and time.monotonic() < deadline:  # waits for samples taken, not for time to pass
      time.sleep(0.01)
    sampler.stop()
    assert sampler.samples >= 3
    sizes = [mb for _, mb in sampler.peak_processes]
    assert len(sizes) == 2 and sizes == sorted(sizes, reverse=True)  # the child and its grandchild, largest first
    assert sizes[0] >= HOLD_MB  # the grandchild's touched bytes
    assert sampler.peak_bytes >= sum(sizes) * 2**20 * 0.99  # the peak is the tree's sum (MB rounded)
    assert sampler.peak_processes[0][0].startswith("python")
  finally:
    child.kill()
    child.wait(timeout=30)
