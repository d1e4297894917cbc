"""A run's memory as its goal means it: the peak resident memory of the whole run, every process of it at once.

`run_measured(command)` starts the command and samples, every `period` seconds, the resident memory of its process
and every descendant (reward workers, a fork server, samplers and followers of a launch), summed; the peak of those
sums, and at least the largest single process's own high-water mark (wait4's ru_maxrss, which no sample can miss),
is `peak_rss_mb`. Pages that processes share (a forked worker's) count once per process there; `peak_pss_mb` is the
peak of proportional set sizes (each shared page split between its holders), the run's own footprint, read when the
resident sum peaks (`TreeSampler._run` says why). Linux
/proc only."""

from __future__ import annotations

import os
import subprocess
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _parents() -> dict[int, int]:
  """{pid: parent pid} of every process."""
  out = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          stat = f.read()
      except OSError:  # gone meanwhile
        continue
      out[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
  return out


def tree(root: int) -> list[int]:
  """`root` and its descendants."""
  children: dict[int, list[int]] = {}
  for pid, parent in _parents().items():
    children.setdefault(parent, []).append(pid)
  found, todo = [], [root]
  while todo:
    pid = todo.pop()
    found.append(pid)
    todo.extend(children.get(pid, []))
  return found


def resident_bytes(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/statm") as f:
      return int(f.read().split()[1]) * PAGE
  except OSError:
    return 0


def _name(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/comm") as f:
      return f.read().strip()
  except OSError:
    return "?"


def proportional_bytes(pid: int) -> int:
  """The process's proportional set size (its private pages, and its share of those it shares)."""
  try:
    with open(f"/proc/{pid}/smaps_rollup") as f:
      for line in f:
        if line.startswith("Pss:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


class TreeSampler:
  """Samples the summed resident memory of `root`'s process tree on a thread until `stop()`."""

  def __init__(self, root: int, period: float = 0.2):
    self.root, self.period = root, period
    self.peak_bytes, self.peak_pss_bytes, self.most_processes, self.samples = 0, 0, 0, 0
    self.peak_at_s, self.peak_processes, self._start = 0.0, [], time.perf_counter()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="tree-memory")

  def start(self) -> TreeSampler:
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()

  def _run(self) -> None:
    while not self._stop.is_set():
      pids = tree(self.root)
      sizes = {p: resident_bytes(p) for p in pids}
      resident = sum(sizes.values())
      # PSS is read by walking the process's page tables under its mmap lock (/proc/PID/smaps_rollup), which
      # stalls the measured process's own mmap and munmap meanwhile. Read five times a second, it slowed a
      # colocated SmolLM2 run of step_profile's workload by 13-15% (steady step 12.0 s against 10.5 s run without
      # sampling; forward and backward 9.1 s against 8.0; same sitting). So PSS is read only when the resident sum
      # reaches a new peak (rare once a run is warm), and `peak_pss_mb` is the largest PSS seen at those moments.
      # Resident sizes (statm) cost no walk.
      if resident >= self.peak_bytes:
        self.peak_pss_bytes = max(self.peak_pss_bytes, sum(proportional_bytes(p) for p in pids))
        self.peak_at_s = round(time.perf_counter() - self._start, 1)
        held = [[_name(p), round(b / 2**20)] for p, b in sizes.items() if b]
        self.peak_processes = sorted(held, key=lambda x: -x[1])
      self.peak_bytes = max(self.peak_bytes, resident)
      self.most_processes, self.samples = max(self.most_processes, len(pids)), self.samples + 1
      self._stop.wait(self.period)


def run_measured(command: list[str], *, cwd=None, env=None, period: float = 0.2) -> dict:
  """Runs `command` to its end; {"returncode", "output", "peak_rss_mb" (the whole tree's), "peak_pss_mb",
  "main_peak_rss_mb" (the command's own process), "processes" (the most seen at once), "seconds", and where the
  sampled peak was: "peak_at_s" (seconds after the start) and "peak_processes" ([name, MB] of each process then)}."""
  start = time.perf_counter()
  proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  sampler = TreeSampler(proc.pid, period).start()
  output = []
  reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
  reader.start()
  _, status, usage = os.wait4(proc.pid, 0)
  sampler.stop()
  reader.join()
  proc.returncode = os.waitstatus_to_exitcode(status)
  main_peak = usage.ru_maxrss * 1024  # kB on Linux
  return dict(returncode=proc.returncode, output="".join(output),
              peak_rss_mb=round(max(sampler.peak_bytes, main_peak) / 2**20),
              peak_pss_mb=round(sampler.peak_pss_bytes / 2**20), main_peak_rss_mb=round(main_peak / 2**20),
              processes=sampler.most_processes, seconds=round(time.perf_counter() - start, 1),
              peak_at_s=sampler.peak_at_s, peak_processes=sampler.peak_processes)
