"""Checkpoints with orbax: parameters, optimizer state, step and RNG as arrays; data-iterator state,
ranker state and anything else JSON-serialisable as metadata. The last N are kept; a restore places every
array into the shardings of a template state, so a checkpoint written on one mesh shape restores onto another.

Arrays are stored flat under their pytree key paths, so any pytree (nnx.State, optax states) round
trips without orbax knowing its node types.

Three ways to save, by where the state lives:
- an accelerator's state: orbax's asynchronous save, which copies it to host memory before `save` returns and
  writes while the trainer donates its buffers to the next step;
- a CPU's state, one process: written in the background, on a thread of this checkpointer's own, straight from
  the state's buffers (no copy). The trainer's accumulation reads the parameters and optimizer state without
  donating them; before its optimizer step donates them it calls `wait()`, which returns once the save has
  committed (and raises its error, naming the step). A save thus runs beside the next step's forward and
  backward passes instead of before them, at no memory cost. orbax's own asynchronous save on a CPU is a second
  copy of the state in the same memory: on SmolLM2's RL run it raised the peak from 6.7 to 10.4 GB;
- several processes: synchronous (orbax syncs them with a collective, which must not run beside the step's).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from streamrl_jax import launch
from streamrl_jax.pytrees import flatten_with_names as _flatten
from streamrl_jax.pytrees import unflatten_like as _unflatten
from streamrl_jax.training.trainer import TrainState

SAVED_FIELDS = ("params", "opt_state", "step", "rng")
# orbax's bound on the bytes being written at once (its default, 96 GB, bounds nothing here): a background save runs
# beside the next step's activations. SmolLM2's async run peaked at 6.9 GB with 1 GB, 6.6 GB with 0.25 (its
# steady steps at 6.0 either way). orbax refuses an array larger than the bound (a 151,936 x 1,024 embedding is
# 0.58 GiB): the bound grows to the largest array a save holds, in quarters of a GiB.
WRITE_GB = 0.25


class Checkpointer:
  """Keeps the last `max_to_keep` checkpoints of a TrainState under `directory`."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool | None = None,
               background: bool | None = None, every: int = 1):
    """`every`: steps between the checkpoints a run saves (`due`). `async_save` None: orbax's asynchronous save
    unless jax's default backend is the CPU; `background` None: saved on this checkpointer's own thread where saves
    are not asynchronous and there is one process (see the module's docstring)."""
    if max_to_keep < 1 or every < 1:
      raise ValueError(f"max_to_keep and every must be >= 1, got {max_to_keep} and {every}")
    self.every = every
    self.directory = Path(directory).absolute()
    self.async_save = jax.default_backend() != "cpu" if async_save is None else bool(async_save)
    self.background = (not self.async_save and jax.process_count() == 1) if background is None else bool(background)
    if self.background and (self.async_save or jax.process_count() > 1):
      raise ValueError("a background save needs orbax's synchronous save (async_save=False) and one process")
    self._options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=self.async_save,
                                                 create=True)
    self._write_gb = WRITE_GB
    self._other_items: set[str] = set()  # items of other models' states (`save`'s `others`)
    self._manager = self._make_manager()
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "checkpoint") if self.background else None
    self._in_flight: tuple[int, concurrent.futures.Future] | None = None  # (step, its background write)

  def _make_manager(self) -> ocp.CheckpointManager:
    handlers = {key: ocp.StandardCheckpointHandler(save_concurrent_gb=self._write_gb)
                for key in ("arrays", "aux", *sorted(self._other_items))}
    return ocp.CheckpointManager(self.directory, options=self._options,
                                 item_handlers={**handlers, "extra": ocp.JsonCheckpointHandler()})

  def _with_items(self, keys) -> None:
    """The manager knows items `keys` (a handler each: orbax is told every item's handler when it is made)."""
    if set(keys) - self._other_items:
      self._other_items |= set(keys)
      self._manager.close()
      self._manager = self._make_manager()

  def _bound_for(self, *trees) -> None:
    """Raises the write bound to the largest array of `trees` (orbax writes no array larger than its bound)."""
    largest = max((int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for t in trees for x in jax.tree.leaves(t)),
                  default=0) / 2**30
    if largest > self._write_gb:
      self._write_gb = math.ceil(largest * 4) / 4
      self._manager.close()
      self._manager = self._make_manager()

  def due(self, step: int, last: bool) -> bool:
    """Whether a run saves checkpoint `step`: every `every` steps, and the `last` one it trains (final or stopped)."""
    return last or step % self.every == 0

  def save(self, state: TrainState, extra: dict | None = None, aux=None, step: int | None = None,
           others: Mapping[str, TrainState] | None = None) -> int:
    """Saves `state` as checkpoint `step` (default: its optimizer step); `extra` is JSON metadata, `aux` any
    pytree of arrays saved beside it (the ranker's state), read back by `restore_aux`; `others` the states of other
    models trained with it (a critic), by name, read back by `restore(template, item=name)`. An asynchronous save
    returns once its copy is taken, a background one at once: the caller leaves the states' arrays undonated until
    `wait()` returns."""
    self.wait()  # one save at a time: the previous one commits first
    step = int(jax.device_get(state.step)) if step is None else step
    arrays = _flatten({name: getattr(state, name) for name in SAVED_FIELDS})
    more = {_item(name): _flatten({f: getattr(other, f) for f in SAVED_FIELDS})
            for name, other in (others or {}).items()}
    self._with_items(more)
    self._bound_for(arrays, aux, *more.values())
    items = dict(arrays=ocp.args.StandardSave(arrays), extra=ocp.args.JsonSave(extra or {}),
                 **{key: ocp.args.StandardSave(tree) for key, tree in more.items()})
    if aux is not None:
      items["aux"] = ocp.args.StandardSave(jax.tree.map(np.array, _flatten(aux)))
    if self._writer is not None:
      self._in_flight = step, self._writer.submit(self._write, step, items)
    elif jax.process_count() > 1:  # orbax syncs the processes with a collective over every device
      with launch.launcher(jax.devices()).launching():
        self._write(step, items)
    else:
      self._write(step, items)
    return step

  def _write(self, step: int, items: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def wait(self) -> None:
    """Returns once every save has committed; a background save's error is raised here, naming its step."""
    if self._in_flight is not None:
      step, future = self._in_flight
      self._in_flight = None
      try:
        future.result()
      except Exception as err:
        raise OSError(f"the checkpoint of step {step} in {self.directory} was not saved: {err}") from err
    self._manager.wait_until_finished()

  @property
  def steps(self) -> list[int]:
    """Steps of the committed checkpoints (a save in flight committed first)."""
    self.wait()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    self.wait()
    return self._manager.latest_step()

  def restore(self, template: TrainState, step: int | None = None, item: str = "") -> tuple[TrainState, dict]:
    """(state, extra) of `step` (default: latest), arrays placed like the template's (its mesh); `item`: the state
    saved among `others` under that name, not the main one."""
    self.wait()
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    if step not in self.steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; have {self.steps}")
    key = _item(item) if item else "arrays"
    if item and not (self.directory / str(step) / key).exists():
      raise FileNotFoundError(f"checkpoint {step} in {self.directory} holds no {item} state (saved by a run without "
                              f"one)")
    self._with_items([key] if item else [])
    saved = {name: getattr(template, name) for name in SAVED_FIELDS}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _flatten(saved))
    restored = self._manager.restore(step, args=ocp.args.Composite(**{key: ocp.args.StandardRestore(abstract)},
                                                                   extra=ocp.args.JsonRestore()))
    fields = _unflatten(saved, dict(restored[key]))
    grad_sum = jax.tree.map(lambda g: g * 0, template.grad_sum)
    sums = {k: jnp.zeros_like(v) for k, v in template.sums.items()}  # the template's: a mixture counts more
    return TrainState(grad_sum=grad_sum, sums=sums, **fields), dict(restored.extra or {})

  def restore_aux(self, template, step: int | None = None):
    """The `aux` pytree saved with `step` (default: latest), in the structure of `template` (host arrays)."""
    self.wait()
    step = self.latest_step() if step is None else step
    if step is None or step not in self.steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; have {self.steps}")
    if not (self.directory / str(step) / "aux").exists():
      raise FileNotFoundError(f"checkpoint {step} in {self.directory} holds no aux state (saved without it)")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), _flatten(template))
    restored = self._manager.restore(step, args=ocp.args.Composite(aux=ocp.args.StandardRestore(abstract)))
    return _unflatten(template, {k: np.asarray(v) for k, v in dict(restored.aux).items()})

  def close(self) -> None:
    try:
      self.wait()
    finally:
      if self._writer is not None:
        self._writer.shutdown()
      self._manager.close()


def _item(name: str) -> str:
  """The checkpoint's item of another model's state `name`."""
  return f"{name}_state"
