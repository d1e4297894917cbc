"""One launcher per device set: programs that share devices are launched in one order on every device.

XLA runs a program over several devices as one part per device, and its collectives (all-reduce,
all-gather) as a rendezvous of those parts; each device runs the programs launched onto it in launch order.
Two threads that launch multi-device programs onto overlapping devices on their own can launch A before B
onto one device and B before A onto another: each device then waits in a rendezvous the other never reaches
(XLA's CPU collectives abort the process after 40 s; elsewhere it hangs). Colocated mode is where this meets
a run: the trainer's step, checkpoint and weight publication against the sampler's prefill and decode,
on the same devices.

XLA:CPU adds a second hazard: it runs the parts of programs in flight on a shared pool of threads, not in
order per device, and a part waiting in a rendezvous holds its thread. With as many pool threads as devices
(2 here), two collective programs in flight can each hold one thread while their other parts wait for one:
on a 2-device CPU, 20 alternating launches of two collective programs from ONE thread can deadlock (one run in
three here), and 500 from two threads with a lock over each dispatch too (`python -m tests.launch_stress bare
500`); with 8 forced devices they pass, which is why the tests' 8-device runs never met it. Since a deadlock is
chance, the tests check the rule itself: a colocated run's programs all went through their launcher (`tally`).

The rule: every multi-device program is launched through the `Launcher` of its devices, which holds one lock
per device, taken in device order, across the launch: on accelerators (in-order streams per device) across
the dispatch, on the CPU until the program has finished, so at most one multi-device program is in flight per
device. Programs on disjoint devices never wait for each other; programs on overlapping devices run one after
the other, in the same order on every device. Single-device programs (the ranker's training, the page
table's bookkeeping, warm-up, evaluation on one device) cannot rendezvous and need no launcher.

`Launcher.jit` is `jax.jit` whose calls go through the launcher (the engines', the trainer's and the ranker's
jit boundaries); `put` and `copy` are `jax.device_put` and `jnp.copy` over pytrees through the launcher of
every device they touch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, Sharding

_registry = threading.Lock()
_device_locks: dict[int, threading.RLock] = {}
_tally: collections.Counter = collections.Counter()  # (device ids, program, waited for) -> launches


def tally() -> dict[tuple[tuple[int, ...], str, bool], int]:
  """How many launches each (device ids, program name, waited for under the locks) has had in this process: what a
  run's programs on shared devices went through (tests check that colocated mode's all do)."""
  with _registry:
    return dict(_tally)


@dataclasses.dataclass
class DeviceClock:
  """Per program name: launches, seconds in the dispatch (the call until it returned) and seconds on the device
  (from the dispatch's return until its outputs were ready: a lower bound where the runtime starts a program
  before its dispatch returns)."""

  launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  dispatch_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  device_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, name: str, dispatch_s: float, device_s: float) -> None:
    self.launches[name] += 1
    self.dispatch_s[name] += dispatch_s
    self.device_s[name] += device_s

  @property
  def total_device_s(self) -> float:
    return sum(self.device_s.values())


_clock: DeviceClock | None = None


@contextlib.contextmanager
def device_clock() -> Iterator[DeviceClock]:
  """While inside, every launched program is waited for and timed into the yielded `DeviceClock` (benchmarks:
  the device time of some work). It serializes the host and the device, so time the work's wall apart from it."""
  global _clock
  if _clock is not None:
    raise RuntimeError("a device clock is already running")
  _clock = DeviceClock()
  try:
    yield _clock
  finally:
    _clock = None


def _count(device_ids: tuple[int, ...], name: str, finish: bool) -> None:
  with _registry:
    _tally[(device_ids, name, finish)] += 1


def _lock_of(device_id: int) -> threading.RLock:
  with _registry:
    return _device_locks.setdefault(device_id, threading.RLock())


class Launcher:
  """The launcher of one set of devices (ids in `device_ids`)."""

  def __init__(self, device_ids, *, finish: bool = False):
    """`finish`: a launch holds the locks until its program has finished (XLA:CPU, see above)."""
    self.device_ids = tuple(sorted(set(device_ids)))
    self.finish = finish
    self._locks = [_lock_of(i) for i in self.device_ids]

  @contextlib.contextmanager
  def launching(self, name: str = "") -> Iterator[None]:
    """Holds every device's lock (in device order: no two launchers wait on each other in a circle); a `name`d
    launch is counted (`tally`)."""
    if name:
      _count(self.device_ids, name, self.finish)
    for lock in self._locks:
      lock.acquire()
    try:
      yield
    finally:
      for lock in reversed(self._locks):
        lock.release()

  def __call__(self, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` launched through this launcher (with `finish`, waited for under it)."""
    name, clock = getattr(fn, "__name__", type(fn).__name__), _clock
    with self.launching(name):
      start = time.perf_counter()
      out = fn(*args, **kwargs)
      if self.finish or clock is not None:
        dispatched = time.perf_counter()
        jax.block_until_ready(out)
        if clock is not None:
          clock.add(name, dispatched - start, time.perf_counter() - dispatched)
      return out

  def jit(self, fn, **jit_kwargs) -> Launched:
    """`jax.jit(fn, **jit_kwargs)` whose every call is launched through this launcher."""
    return Launched(self, jax.jit(fn, **jit_kwargs))

  def __repr__(self) -> str:
    return f"Launcher(devices {list(self.device_ids)})"


class Launched:
  """A jitted function whose calls go through a launcher; everything else (`lower`, ...) is the jitted one's."""

  def __init__(self, launcher: Launcher, jitted):
    self.launcher, self.jitted = launcher, jitted
    functools.update_wrapper(self, jitted)

  def __call__(self, *args, **kwargs):
    return self.launcher(self.jitted, *args, **kwargs)

  def __getattr__(self, name):
    return getattr(self.jitted, name)


def devices_of(*where) -> set:
  """Every device of the meshes, shardings, devices and device arrays in `where` (pytrees of them too);
  host values (numpy arrays, numbers) have none."""
  found = set()
  for leaf in jax.tree.leaves(where, is_leaf=lambda x: isinstance(x, (Mesh, Sharding))):
    if isinstance(leaf, Mesh):
      found.update(leaf.devices.flat)
    elif isinstance(leaf, Sharding):
      found.update(leaf.device_set)
    elif isinstance(leaf, jax.Array):
      found.update(leaf.sharding.device_set)
    elif isinstance(leaf, jax.Device):
      found.add(leaf)
  return found


def launcher(*where) -> Launcher:
  """The launcher of every device in `where` (see `devices_of`); on the CPU its launches finish under it."""
  devices = devices_of(*where)
  return Launcher((d.id for d in devices), finish=any(d.platform == "cpu" for d in devices) and len(devices) > 1)


def shapes_only(tree) -> bool:
  """Whether `tree` holds shapes (`jax.ShapeDtypeStruct`s) and no array: what a plan places (`planning/`)."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def put(tree, shardings):
  """`jax.device_put(tree, shardings)` launched on every device of both (a reshard between layouts on shared
  devices is a multi-device program). Transfers and copies hold no rendezvous, so even on the CPU they are
  ordered at dispatch and not waited for. A tree of shapes is placed as shapes: each given its sharding."""
  if shapes_only(tree):
    if isinstance(shardings, Sharding):
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  with launcher(tree, shardings).launching("put"):
    return jax.device_put(tree, shardings)


def delete(tree) -> None:
  """Frees every array of `tree` now (`jax.Array.delete`), whoever else still names it: a donation by hand, for a
  caller that hands its arrays over once their readers hold copies of their own (finished: wait for them first)."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()


def copy(tree):
  """A private copy of every array of `tree` (`jnp.copy`), launched on the tree's devices (a tree of shapes is its
  own copy)."""
  if shapes_only(tree):
    return tree
  with launcher(tree).launching("copy"):
    return jax.tree.map(jnp.copy, tree)
