"""The follower arms of a run (`ArmsConfig.followers`): a trainer worker each, on its own thread and mesh, fed by
the lead's fan-out (`arm_feed`). A follower answers the controller's questions itself (`FollowerControl`: it
leases nothing, regenerates nothing; its backfill counts follow the controller's rule on the same groups), and
publishes nowhere. It never holds the lead up: the lead only offers shards to its feed. A follower that fails is
logged and closed; the lead and the other arms go on, and a resumed run restarts it from its own checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from streamrl_jax.arms.feed import ArmFeed, Fanout, FollowerSource
from streamrl_jax.arms.config import ArmConfig, ArmsConfig, arm_shape, arm_trainer
from streamrl_jax.messages import row_step
from streamrl_jax.records.metric_table import ARMS
from streamrl_jax.records.metrics_log import PeriodicEval
from streamrl_jax.pipeline.trainer.control import FollowerControl
from streamrl_jax.pipeline.trainer.worker import TrainerSetup, TrainerWorker
from streamrl_jax.run_shape import RunShape
from streamrl_jax.streaming import QueueClosed

_log = logging.getLogger(__name__)


class NoPublisher:
  """A follower's weight publisher: its versions stay with it."""

  seconds: dict = {}

  def publish(self, params, version: int) -> None:
    pass

  def wait(self) -> None:
    pass


def arm_parts(name: str, source: FollowerSource, periodic: PeriodicEval | None,
              params: Callable[[], object]) -> tuple[Callable[[dict], dict], ...]:
  """A follower's row parts (`metric_table.join_row`): its arm keys (its name, its policy's divergence from the
  sampler's (`logprob_mismatch_kl`), how far behind the lead it is, its skips so far; its step's samples are then its
  own), and with `periodic` the held-out accuracy of its policy `params()`."""
  def arm_part(row: dict) -> dict:
    source.trained(row["step"] - 1)
    return {ARMS: dict(arm=name, arm_policy_divergence=row.get("logprob_mismatch_kl", 0.0),
                       arm_lag=source.lag(row["step"]), **source.counters)}
  return (arm_part,) if periodic is None else (arm_part, periodic.row_part(params))


def feed_capacity(shape: RunShape, arms: ArmsConfig) -> int:
  """Samples a follower's feed holds: its lag bound's steps (`arms.max_lag`), the lead's staleness window's, and one
  step of slack, each with its backfill."""
  per_step = (shape.prompts_per_step + shape.backfill_per_step) * shape.group_size
  return (arms.max_lag + shape.spec.max_lag + 2) * per_step


def arm_setup(setup: TrainerSetup, arm: ArmConfig) -> TrainerSetup:
  """The lead's trainer setup as follower `arm` trains: its own trainer config and advantage estimator and seed."""
  return dataclasses.replace(setup, trainer=arm_trainer(setup.trainer, arm), shape=arm_shape(setup.shape, arm))


@dataclasses.dataclass(frozen=True)
class ArmsStart:
  """Where the follower arms begin: the run's `first_step`; with `resume`, each from its own checkpoint where it has
  one; each arm's (checkpointer, on_step) by name (`outputs`); the held-out accuracy of each on its due rows
  (`periodic_eval`)."""

  first_step: int
  resume: bool = False
  outputs: dict | None = None
  periodic_eval: PeriodicEval | None = None


class _Arm:
  """One follower, `name`: its worker (of `setup`), feed, source and thread, and how it ended."""

  def __init__(self, name: str, setup: TrainerSetup, arms: ArmsConfig, graphdef, params, mesh, start: ArmsStart):
    self.name = name
    checkpointer, on_step = (start.outputs or {}).get(self.name, (None, None))
    resume = start.resume and checkpointer is not None and checkpointer.latest_step() is not None
    self.worker = TrainerWorker(setup, graphdef, params, mesh, checkpointer=checkpointer, resume=resume,
                                streamed=False)
    self.feed = ArmFeed(feed_capacity(setup.shape, arms))
    self.source = FollowerSource(self.feed, arms.max_lag, start.first_step)
    self.on_step, self.metrics, self.error, self.periodic_eval = on_step, [], None, start.periodic_eval
    self.thread = threading.Thread(target=self._run, daemon=True, name=f"arm-{self.name}")

  def _run(self) -> None:
    start = time.monotonic()
    try:
      parts = arm_parts(self.name, self.source, self.periodic_eval, lambda: jax.device_get(self.worker.policy_params()))
      self.metrics = self.worker.run(FollowerControl(self.worker.shape), self.source.get, NoPublisher(),
                                     clock=lambda: time.monotonic() - start, on_step=self.on_step, row_parts=parts,
                                     skip=self.source.skip)
    except QueueClosed:  # the lead stopped before this follower's last step: it ends at its last whole step
      pass
    except BaseException as err:  # the lead and the other arms go on
      self.error = err
      self.feed.close(discard=True)
      _log.error(f"arm {self.name!r} failed at step {row_step(self.source.step)}: {type(err).__name__}: {err}; the "
                 "lead goes on (a resumed run restarts the arm from its checkpoint)")
    finally:
      if self.worker.checkpointer is not None:
        self.worker.checkpointer.wait()

  def counters(self) -> dict:
    """The worker's counters and the arm's: steps and samples skipped (a skipped step's samples, those thrown
    away at a stop or failure, and those left unread), samples the full feed refused. Every sample offered is
    in `samples_trained`, `duplicate_samples`, `arm_samples_skipped` or `arm_samples_refused` (stale groups:
    `groups_regenerated`)."""
    feed = self.feed.stats()
    left = feed["depth"] + feed["discarded_samples"]
    return dict(self.worker.counters, **self.source.counters, arm_samples_refused=feed["refused_samples"],
                arm_samples_offered=feed["offered_samples"], arm_feed_max_depth=feed["max_depth"],
                arm_failed=int(self.error is not None)) | {
                    "arm_samples_skipped": self.source.counters.arm_samples_skipped + left}


class Followers:
  """The follower arms of `arms`, each trained as the lead's `setup` with its own trainer settings: `start` their
  threads, let `fanout` tap the lead's shard source and rows, then `finish`."""

  def __init__(self, setup: TrainerSetup, arms: ArmsConfig, graphdef, params, meshes: list, start: ArmsStart):
    self.arms = [_Arm(arm.name, arm_setup(setup, arm), arms, graphdef, params, mesh, start)
                 for arm, mesh in zip(arms.followers, meshes)]
    self.fanout = Fanout({arm.name: arm.feed for arm in self.arms}, arms.lead_name)

  def start(self) -> None:
    for arm in self.arms:
      arm.thread.start()

  def finish(self, discard: bool) -> dict:
    """Ends the stream (with `discard`, the followers' queued samples too: a stop or a failure) and waits for the
    followers to train what they hold; returns {arm name: (metrics, counters, its worker; None for one that failed,
    whose state may be half way through a step)}."""
    self.fanout.close(discard)
    for arm in self.arms:
      arm.thread.join()
    return {arm.name: (arm.metrics, arm.counters(), arm.worker if arm.error is None else None) for arm in self.arms}


def follower_meshes(trainer_mesh, spare_devices: list, count: int) -> list:
  """A mesh per follower: its own devices, shaped as the trainer's, while `spare_devices` last; then the trainer's
  mesh itself (the follower's steps then take turns with the lead's on it)."""
  size = trainer_mesh.devices.size
  meshes = []
  for i in range(count):
    own = spare_devices[i * size:(i + 1) * size]
    meshes.append(Mesh(np.asarray(own).reshape(trainer_mesh.devices.shape), trainer_mesh.axis_names)
                  if len(own) == size else trainer_mesh)
  return meshes


def spare_devices(devices, *meshes) -> list:
  """The devices (default: all) that none of `meshes` uses, in order."""
  used = {d.id for mesh in meshes for d in mesh.devices.flat}
  return [d for d in (jax.devices() if devices is None else devices) if d.id not in used]


def make_followers(setup: TrainerSetup, arms: ArmsConfig, graphdef, params, trainer_mesh, spare: list,
                   start: ArmsStart) -> Followers | None:
  """The run's `Followers` of `arms` (None without arms; `setup`: the lead's trainer), on meshes by
  `follower_meshes`, starting at `start`."""
  if not arms.followers:
    return None
  return Followers(setup, arms, graphdef, params, follower_meshes(trainer_mesh, spare, len(arms.followers)), start)
