"""The follower program (`streamrl follower`): one follower arm of a run in a program of its own, reading its
stream from the lead trainer's Flight server (`pipeline.remote_arms` is the lead's side).

It joins (its run id, kept beside its checkpoints, and its settings are checked by the lead), starts from its own
checkpoint or else from the lead's weights of the run's first version, and trains as an in-process follower does:
a `TrainerWorker` fed by a local `ArmFeed`, which a reader thread fills from the lead (DoGet) and keeps told of the
lead's progress and dropped steps (`ArmPoll`). A poll acknowledges the steps whose checkpoint has committed; the
lead lets their shards go then, and not before, so a follower killed at any point and started again with the same
workdir trains every sample it had not saved, and none twice. Its outputs are those of an in-process arm
(`arm_outputs`), in its own workdir (by default the lead's WORKDIR/arms/NAME).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import jax
import pyarrow.flight as flight
from flax import nnx

from streamrl_jax.messages import ArmJoin, ArmJoined, ArmPoll, ArmState, VersionInfo, VersionQuery, row_step
from streamrl_jax.meshes import role_mesh
from streamrl_jax.arms.feed import ArmFeed, FollowerSource
from streamrl_jax.arms.outputs import describe_arm, finish_arm
from streamrl_jax.job.evaluation import held_out_of
from streamrl_jax.arms.config import ArmConfig
from streamrl_jax.arms.followers import NoPublisher, arm_parts, arm_setup, feed_capacity
from streamrl_jax.records.metrics_log import PeriodicEval, append_row, open_metrics
from streamrl_jax.records.run_files import read_accuracy_before, write_arm
from streamrl_jax.records.run_record import RUN_ID_FILE, write_run_id
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.trainer.control import FollowerControl
from streamrl_jax.pipeline.parts import trainer_setup
from streamrl_jax.pipeline.trainer.worker import TrainerWorker
from streamrl_jax.pytrees import unflatten_like
from streamrl_jax.training.checkpoint import Checkpointer
from streamrl_jax.settings import flat_settings
from streamrl_jax.streaming import QueueClosed
from streamrl_jax.streaming.flight_client import FlightConnection, VersionGone, fetch_weights
from streamrl_jax.streaming.flight_config import FlightConfig
from streamrl_jax.streaming.sample_schema import WireLimits, batch_to_shard

_log = logging.getLogger(__name__)

READ_DEADLINE_S = 60.0  # one DoGet of the stream (the lead answers within its READ_WAIT_S)


class _Saved:
  """The steps below `value` are checkpointed and committed: written by the follower's thread, read by the reader."""

  def __init__(self, value: int):
    self._value, self._lock = value, threading.Lock()

  def set(self, value: int) -> None:
    with self._lock:
      self._value = max(self._value, value)

  def get(self) -> int:
    with self._lock:
      return self._value


class _CommittingCheckpointer:
  """The follower's checkpointer, telling `saved` which steps have committed: before each save the previous one
  is waited for (an asynchronous save is only safe to acknowledge once on disk)."""

  def __init__(self, inner, saved: _Saved):
    self.inner, self.saved = inner, saved

  def save(self, state, extra=None, aux=None, step=None, others=None) -> None:
    self.inner.wait()
    self.saved.set(self.inner.latest_step() or 0)
    self.inner.save(state, extra=extra, aux=aux, step=step, others=others)

  def __getattr__(self, name):
    return getattr(self.inner, name)


class _StreamReader:
  """The reader thread: the lead's shards into the local feed, the lead's progress and dropped steps with them,
  acknowledging what `saved` says is committed. It ends when the lead's stream is closed and read whole, or
  `halt` is set; a failure is kept in `error` and closes the feed."""

  def __init__(self, connection: FlightConnection, name: str, run_id: str, feed: ArmFeed, saved: _Saved,
               limits: WireLimits):
    self.connection, self.name, self.run_id, self.feed, self.saved, self.limits = (connection, name, run_id, feed,
                                                                                   saved, limits)
    self.after, self.error, self.halt = -1, None, threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True, name=f"arm-{name}-reader")

  def _read(self) -> list:
    ticket = flight.Ticket(json.dumps({"arm": self.name, "after": self.after}).encode())
    reader = self.connection.client.do_get(ticket, options=self.connection.options(READ_DEADLINE_S))
    return [batch_to_shard(chunk.data, self.limits) for chunk in reader]

  def _run(self) -> None:
    try:
      while not self.halt.is_set():
        got = self.connection.call(self._read)
        for shard, envelope in got:
          self.feed.offer(shard)
          self.after = max(self.after, envelope.seq)
        state = self.poll()
        self.feed.lead_trained(state.lead_done)
        self.feed.mark_dropped(state.dropped)
        if state.closed and not got:
          break
    except BaseException as err:  # the follower's get then ends: the error is raised in its words
      self.error = err
    finally:
      self.feed.close()

  def poll(self) -> ArmState:
    return self.connection.action(ArmPoll(self.name, self.run_id, self.saved.get()), ArmState)


def follow_lead(config: PipelineConfig, job, arm_name: str, *, connect: str, workdir: Path, tls=None, devices=None,
                flight_config: FlightConfig = FlightConfig()) -> dict:
  """Runs follower arm `arm_name` of `config.arms.followers` against the lead at `connect` until the lead's stream ends;
  returns the arm's summary (also WORKDIR/summary.json). `flight_config`: call deadlines and how long to keep
  trying to reach the lead (its warm-up, a restart)."""
  arm = next((a for a in config.arms.followers if a.name == arm_name), None)
  if arm is None:
    raise ValueError(f"arm {arm_name!r} is not among --arms ({[a.name for a in config.arms.followers]})")
  lead, workdir = config.resolved(job.dtype()), Path(workdir)  # 'auto': float32 weights
  workdir.mkdir(parents=True, exist_ok=True)
  connection = FlightConnection(connect, tls=tls, timeout_s=flight_config.call_timeout_s,
                                retry_s=flight_config.connect_retry_s, peer="the lead trainer")
  joined = _join(connection, config, job, arm, workdir)
  base = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  resumed_at = base.latest_step()
  saved = _Saved(resumed_at or 0)
  model, tokenizer, _ = job.load_model()
  graphdef, params = nnx.split(model)
  if resumed_at is None:
    params = _lead_weights(connection, params, joined.start_step)
  start = f"resuming after its step {resumed_at}" if resumed_at else f"starting at step {row_step(joined.start_step)}"
  _log.info(f"arm {arm.name!r}: joined run {joined.run_id}; {start}")
  mesh = role_mesh(config.mesh, "trainer", devices)
  worker = TrainerWorker(arm_setup(trainer_setup(lead), arm), graphdef, params, mesh,
                         checkpointer=_CommittingCheckpointer(base, saved), resume=resumed_at is not None,
                         streamed=False)
  feed = ArmFeed(feed_capacity(config.shape, config.arms))
  reader = _StreamReader(connection, arm.name, joined.run_id, feed, saved,
                         WireLimits.of_run(config.sampler.engine, config.samples_per_step, model.config.vocab_size,
                                           model.config))
  source = FollowerSource(feed, config.arms.max_lag, first_step=joined.start_step)
  held_out = held_out_of(job, tokenizer, job.make_task(tokenizer, "eval"), lead.sampler, lead.max_new_tokens)
  periodic = (PeriodicEval(job.eval_every, lambda p: held_out.scores(nnx.merge(graphdef, p)).metrics())
              if job.eval_every else None)
  reader.thread.start()
  try:
    completed = _train(worker, arm.name, source, reader, open_metrics(workdir, resumed_at), periodic)
    base.wait()
    saved.set(config.steps if completed else base.latest_step() or 0)  # every step trained and saved, or skipped
    reader.halt.set()
    reader.poll()  # the last acknowledgement: the lead may end
  finally:
    reader.halt.set()
    connection.close()
    base.wait()
    base.close()
  return finish_arm(workdir, arm, config.steps, nnx.merge(graphdef, worker.policy_params()),
                    dict(worker.counters, **source.counters),
                    read_accuracy_before(workdir.parent.parent), held_out)  # the lead's, when WORKDIR/arms/NAME


def _join(connection: FlightConnection, config: PipelineConfig, job, arm: ArmConfig, workdir: Path) -> ArmJoined:
  """Joins the lead's run (its id kept in WORKDIR, its settings checked by the lead) and describes the arm there."""
  id_file = workdir / RUN_ID_FILE
  joined = connection.action(ArmJoin(arm.name, id_file.read_text().strip() if id_file.exists() else "",
                                     flat_settings(config, job)), ArmJoined)
  write_run_id(workdir, joined.run_id)
  write_arm(workdir, describe_arm(arm))
  return joined


def _train(worker: TrainerWorker, name: str, source: FollowerSource, reader: _StreamReader, metrics,
           periodic: PeriodicEval | None) -> bool:
  """Trains arm `name`'s steps as the lead's stream brings them, each row into `metrics` (an open metrics file);
  whether every step was trained (False: the lead's stream ended first)."""
  start = time.monotonic()
  with metrics as out:
    parts = arm_parts(name, source, periodic, lambda: jax.device_get(worker.policy_params()))
    try:
      worker.run(FollowerControl(worker.shape), source.get, NoPublisher(), clock=lambda: time.monotonic() - start,
                 on_step=lambda row: append_row(out, row), row_parts=parts, skip=source.skip)
      return True
    except QueueClosed:
      if reader.error is not None:
        raise reader.error
      _log.warning(f"arm {name!r}: the lead's stream ended before step {worker.shape.steps}")
  return False


def _lead_weights(connection: FlightConnection, template, version: int):
  """The lead's weights of `version` (the run's first) as `template`'s tree (float32 on the wire: `to_wire`); the
  newest the lead holds when that one is gone (the follower joined late: it starts from the lead's policy then)."""
  newest = -1
  while newest < version:  # the lead publishes its first version as its steps begin
    newest = connection.action(VersionQuery(version, 30.0), VersionInfo, timeout=60.0).version
  try:
    _, flat, _ = fetch_weights(connection, version)
  except VersionGone:
    newest = connection.action(VersionQuery(version), VersionInfo).version
    _log.warning(f"the lead no longer holds version {version}: starting from its version {newest}")
    _, flat, _ = fetch_weights(connection, newest)
  return unflatten_like({"values": template, "scales": {}}, flat, "the lead's weights")["values"]  # float32 wire
