"""Follower arms as programs of their own (`ArmsConfig.programs`, `streamrl follower`): the lead's side.

Each declared arm has a retained `ArmFeed` on the lead, filled by the same fan-out as in-process followers. The
trainer's Flight server serves it: a follower joins (`ArmJoin`: its run id and settings checked), reads its stream
by DoGet (ticket `{"arm": NAME, "after": SEQ}`: the shards numbered above SEQ, as sample batches) and polls
(`ArmPoll`: it acknowledges the steps it has checkpointed, whose shards are then let go, and learns the lead's
progress and the steps its feed dropped). A follower that dies and restarts from its checkpoint reads again every
shard it had not acknowledged, so each sample it saved was trained once. The lead never waits on a follower,
except at the end of the run, for each live follower to acknowledge its stream (`finish`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from streamrl_jax.messages import ArmJoin, ArmJoined, ArmPoll, ArmState, BadMessage, quote
from streamrl_jax.arms.feed import ArmFeed, Fanout
from streamrl_jax.arms.config import ArmsConfig, stream_settings
from streamrl_jax.arms.followers import feed_capacity
from streamrl_jax.run_shape import RunShape
from streamrl_jax.streaming import SampleShard

_log = logging.getLogger(__name__)

READ_WAIT_S = 5.0  # how long one DoGet of an arm's stream waits for a shard before it ends empty
DROPPED_SHOWN = 4096  # the most recent dropped steps an ArmState carries
GONE_S = 60.0  # at the end: a follower not heard from for this long is not waited for


class RemoteArms:
  """The follower programs' streams on the lead (a run of `shape`, its `arms`): `fanout` taps the lead's shard
  source and rows as `Followers`' does; `join`, `poll` and `read` answer the Flight server; `finish` at the end."""

  def __init__(self, shape: RunShape, arms: ArmsConfig, run_id: str, start_step: int, settings: dict,
               clock: Callable[[], float] = time.monotonic):
    self.run_id, self.start_step, self.steps = run_id, start_step, shape.steps
    self.settings, self.clock = stream_settings(settings), clock
    self.feeds = {arm.name: ArmFeed(feed_capacity(shape, arms), retain=True) for arm in arms.followers}
    self.fanout = Fanout(self.feeds, arms.lead_name)
    self._heard: dict[str, float] = {}  # arm -> when it last joined or polled
    self._lock = threading.Lock()

  def start(self) -> None:
    pass

  def _feed(self, name: str, run_id: str) -> ArmFeed:
    feed = self.feeds.get(name)
    if feed is None:
      raise BadMessage(f"arm {quote(name)} is not an arm of this run (its arms: {sorted(self.feeds)}); start the "
                       "lead with --arms naming its file")
    if run_id and run_id != self.run_id:
      raise BadMessage(f"arm {quote(name)} belongs to run {quote(run_id)} (its workdir's checkpoints), but this lead "
                       f"runs {self.run_id}: give the follower this run's WORKDIR/arms/{name}, or a fresh workdir")
    with self._lock:
      self._heard[name] = self.clock()
    return feed

  def join(self, message: ArmJoin) -> ArmJoined:
    self._feed(message.name, message.run_id)
    theirs = stream_settings(message.settings)
    differing = sorted(k for k in set(theirs) | set(self.settings) if theirs.get(k) != self.settings.get(k))
    if differing:
      key = differing[0]
      raise BadMessage(f"arm {quote(message.name)} runs another stream than the lead: {len(differing)} settings "
                       f"differ, first {quote(key)} = {quote(theirs.get(key))} (arm) vs {quote(self.settings.get(key))}"
                       " (lead); give both the same --config and --set")
    _log.info(f"arm {message.name!r} joined (run {self.run_id})")
    return ArmJoined(self.run_id, self.start_step, self.steps)

  def poll(self, message: ArmPoll) -> ArmState:
    feed = self._feed(message.name, message.run_id)
    feed.acknowledge(message.checkpointed)
    lead_done, dropped = feed.view()
    return ArmState(lead_done, tuple(sorted(dropped)[-DROPPED_SHOWN:]), feed.closed)

  def read(self, name: str, after: int) -> list[tuple[int, SampleShard]]:
    """The shards of arm `name` numbered above `after` (waiting up to READ_WAIT_S for one)."""
    return self._feed(name, "").read(after, READ_WAIT_S)

  def finish(self, discard: bool) -> dict:
    """Closes the streams; after a whole run, waits for each follower heard from in the last GONE_S seconds to
    acknowledge its stream (a follower that joins later reads it on its own)."""
    self.fanout.close()
    if discard:
      return {}
    for name, feed in self.feeds.items():
      said = False
      while not feed.wait_empty(1.0) and self._heard_within(name, GONE_S):
        if not said:
          _log.info(f"waiting for arm {name!r} to train what it holds ({feed.stats()['depth']} samples)")
          said = True
    return {}

  def _heard_within(self, name: str, seconds: float) -> bool:
    with self._lock:
      return name in self._heard and self.clock() - self._heard[name] < seconds
