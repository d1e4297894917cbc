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
from streamrl_jax.pipeline import run_pipeline
from streamrl_jax.training.checkpoint import Checkpointer
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask


@pytest.mark.slow
def test_colocated_on_two_devices_trains_with_a_checkpoint_every_step_three_times(tmp_path):
  """Colocated mode on exactly 2 CPU devices (where unordered launches deadlock, unlike the suite's 8): the
  trainer's parameters split over both, a checkpoint after each of 20 steps, three runs in one process."""
  done = subprocess.run([sys.executable, "-m", "tests.colocated_runs", str(tmp_path), "3", "20"], capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  assert len(runs) == 3 and all(r["devices"] == 2 and r["split_parameters"] > 0 for r in runs)
  assert all(r["steps"] == list(range(1, 21)) and r["checkpoint"] == 20 for r in runs)


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
                          devices=jax.devices()[:4], checkpointer=checkpointer)
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


def test_without_the_launcher_the_same_launches_deadlock_on_two_cpu_devices():
  """The hazard the launcher guards against, shown where that is safe: in a process of its own, killed when it
  has not finished 10 s after it started (the launcher's run of 500 launches each takes well under a second)."""
  bare = _stress("bare", 500, timeout=10)
  if bare is not None and bare.returncode == 0:
    pytest.skip("this machine's XLA:CPU ran 500 unordered collective launches from two threads without deadlock")
  assert bare is None or "rendezvous" in bare.stderr, bare  # stuck, or aborted by XLA's rendezvous timeout


def test_a_launcher_holds_each_device_once_in_order_and_only_its_own():
  first, second = launch.Launcher([3, 1]), launch.Launcher([1, 2])
  assert first.device_ids == (1, 3) and launch.launcher(*jax.devices()[:2]).device_ids == (0, 1)
  entered, release = threading.Event(), threading.Event()

  def hold():
    with first.launching():
      entered.set()
      release.wait(10)
  holder = threading.Thread(target=hold)
  holder.start()
  assert entered.wait(10)
  with launch.Launcher([2, 4]).launching():  # disjoint from the holder: no wait
    pass
  got = []
  waiter = threading.Thread(target=lambda: got.append(second(lambda: "launched")))  # shares device 1: waits
  waiter.start()
  waiter.join(0.2)
  assert waiter.is_alive() and not got
  release.set()
  holder.join(10)
  waiter.join(10)
  assert got == ["launched"]
  with first.launching(), first.launching():  # re-entrant on its own thread
    pass
