"""One launcher per device set: programs on shared devices launched in one order from several threads.

The hazard: two threads launching multi-device programs (with collectives) onto the same devices on their
own may order them differently per device, and each device then waits in a rendezvous the other never reaches.
"""

import dataclasses
import json
import subprocess
import sys
import threading

import jax
import pytest
from flax import nnx

from streamrl_jax import launch
from streamrl_jax.models import Transformer
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.training.checkpoint import Checkpointer
from streamrl_jax.pipeline.run_hooks import RunHooks
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask


@pytest.mark.slow
def test_colocated_on_two_devices_trains_with_a_checkpoint_every_step_three_times(tmp_path):
  """Colocated mode on exactly 2 CPU devices (where unordered launches deadlock, unlike the suite's 8): the
  trainer's parameters split over both, a checkpoint after each of 20 steps, three runs in one process. Whether
  unordered launches deadlock in a given run is chance (XLA:CPU's pool), so the run also shows how it was safe:
  every program of the trainer and of the sampler on the shared devices went through their one launcher and was
  waited for under it (the colocated SmolLM2 run that crashed launched them from two threads on their own)."""
  done = subprocess.run([sys.executable, "-m", "tests.colocated_runs", str(tmp_path), "3", "20"], capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  assert len(runs) == 3 and all(r["devices"] == 2 and r["split_parameters"] > 0 for r in runs)
  assert all(r["steps"] == list(range(1, 21)) and r["checkpoint"] == 20 for r in runs)
  launched = {name: (ids, finish) for ids, name, finish, _ in runs[-1]["launches"]}
  trainer, sampler = {"_accumulate_impl", "_apply_impl"}, {"_prefill_impl", "_insert_impl", "_generate_impl"}
  assert trainer | sampler <= set(launched), sorted(launched)
  assert all(ids == [0, 1] and finish for ids, finish in launched.values()), launched


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disaggregated", "stream", "async"])
def test_two_mesh_modes_train_a_model_sharded_over_two_trainer_devices(tmp_path, mode):
  """The trainer's parameters split over its 2 devices (all-gathers and all-reduces in each step), the sampler
  on 2 others, a checkpoint after every step."""
  config = dataclasses.replace(BASE, mode=mode, steps=6, prompts_per_step=2, group_size=2,
                               mesh=dataclasses.replace(BASE.mesh, sampler_devices=2, trainer_devices=2))
  checkpointer = Checkpointer(tmp_path, max_to_keep=1)
  try:
    result = run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, DigitTask(max_digits=3),
                          devices=jax.devices()[:4], hooks=RunHooks(checkpointer))
  finally:
    checkpointer.close()
  assert [m["step"] for m in result.metrics] == list(range(1, 7)) and checkpointer.latest_step() == 6


def _stress(how: str, launches: int, timeout: float) -> subprocess.CompletedProcess | None:
  """tests/launch_stress.py in its own 2-device process; None when it did not finish within `timeout`."""
  try:
    return subprocess.run([sys.executable, "-m", "tests.launch_stress", how, str(launches)], capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return None


def test_two_threads_launching_collectives_through_the_launcher_finish():
  done = _stress("launcher", 500, timeout=120)
  assert done is not None and done.returncode == 0 and "done" in done.stdout, done


class _WatchedLock:
  """A device lock that says when a thread finds it taken and waits (so a test knows the waiter waits)."""

  def __init__(self):
    self.lock, self.blocked = threading.RLock(), threading.Event()

  def acquire(self):
    if not self.lock.acquire(blocking=False):
      self.blocked.set()
      self.lock.acquire()

  def release(self):
    self.lock.release()


def test_a_launcher_holds_each_device_once_in_order_and_only_its_own(monkeypatch):
  device_one = _WatchedLock()
  monkeypatch.setitem(launch._device_locks, 1001, device_one)  # ids no other launcher of the session uses
  first, second = launch.Launcher([1003, 1001]), launch.Launcher([1001, 1002])
  assert first.device_ids == (1001, 1003) and launch.launcher(*jax.devices()[:2]).device_ids == (0, 1)
  entered, release = threading.Event(), threading.Event()

  def hold():
    with first.launching():
      entered.set()
      release.wait(10)
  holder = threading.Thread(target=hold)
  holder.start()
  assert entered.wait(10)
  with launch.Launcher([1002, 1004]).launching():  # disjoint from the holder: no wait
    pass
  got = []
  waiter = threading.Thread(target=lambda: got.append(second(lambda: "launched")))  # shares device 1001: waits
  waiter.start()
  assert device_one.blocked.wait(10) and not got  # it found the device taken, and has not launched
  release.set()
  holder.join(10)
  waiter.join(10)
  assert got == ["launched"]
  with first.launching(), first.launching():  # re-entrant on its own thread
    pass


def test_the_device_clock_times_each_launch_it_sees_and_only_while_on():
  import jax.numpy as jnp

  runner = launch.launcher(jax.devices()[:1])
  square = runner.jit(lambda x: x @ x)
  x = jnp.ones((64, 64))
  square(x)  # compiled, and not timed: no clock is on
  with launch.device_clock() as clock:
    out = [square(x) for _ in range(3)]
    with pytest.raises(RuntimeError, match="already running"), launch.device_clock():
      pass
  square(x)
  assert dict(clock.launches) == {"<lambda>": 3} and float(out[0][0, 0]) == 64.0
  assert clock.device_s["<lambda>"] > 0 and clock.dispatch_s["<lambda>"] > 0
  assert clock.total_device_s == clock.device_s["<lambda>"]
