"""The controller: the step plans (made by the pure functions of `step_plan`), the leases and the samplers'
roster, the version gate, the replica target (by the elastic rule, from each trained step's times) and what
the samplers reported. It owns this state alone; samplers and the trainer reach it only
through the typed messages of `streamrl_jax.messages` (directly in one process, over Arrow Flight
DoAction across processes), each handled under one lock.

A step's prompts depend on (seed, step) alone, so a resumed run continues the data stream exactly. A step
opens once the trainer has published version >= step - max_lag; its prompts are then cut into one lease per
live sampler, and samplers pull leases (a sampler that is done early takes the next open step's lease).

Faults: a sampler that leaves, or is silent for `lease_timeout_s` (checked by `start_watchdog`), loses its
leases, which go back to the front of their steps for the others. A lost sampler's samples that arrive late
are still taken (the trainer keeps the first copy of each (step, group, sample)), and it is told to register
again. Sampler ids are random, so a sampler of a trainer that restarted is unknown here and told the same.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np

from streamrl_jax.messages import (Ack, BadMessage, BadShard, Heartbeat, HeartbeatReply, Lease, LeaseReply, LeaseRequest,
                                   Leave, Partial, Register, Registered, StepReport, quote)
from streamrl_jax.pipeline.step_plan import (StepPlan, backfill_count, backfill_prompts, cut_prompts, min_version,
                                             partial_problem, step_group_ids, step_leases, step_prompts)
from streamrl_jax.pipeline.watchdog import Watchdog
from streamrl_jax.scheduling import lengths_from_scores, ranking_metrics
from streamrl_jax.scheduling.broadcast import TreeMember, broadcast_tree, draw_tree
from streamrl_jax.streaming.flight_config import parse_address
from streamrl_jax.tasks.rows import prompt_tokens

MAX_LEASE_WAIT_S = 30.0


@dataclasses.dataclass
class _Sampler:
  name: str
  last_seen: float
  leases: set = dataclasses.field(default_factory=set)
  told_to_stop: bool = False
  wait_s: float = 0.0
  rss_mb: float = 0.0
  site: str = ""
  relay: str = ""  # where it serves the weight versions it holds ("": it does not)


class Controller:
  """Plans steps and answers the control messages; thread-safe."""

  def __init__(self, config, task, tokenizer, *, start_step: int, settings: dict | None = None, ranker=None,
               heartbeat_s: float = 2.0, lease_timeout_s: float = 10.0, summary_timeout_s: float = 600.0,
               on_event: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic,
               site: str = "", weight_fanout: int = 1):
    self.config, self.spec, self.task, self.tokenizer, self.ranker = config, config.spec, task, tokenizer, ranker
    self.settings, self.heartbeat_s, self.start_step = dict(settings or {}), heartbeat_s, start_step
    self.lease_timeout_s, self.summary_timeout_s, self._on_event = lease_timeout_s, summary_timeout_s, on_event
    self._clock = clock  # when samplers were last heard from
    self.site, self.weight_fanout = site, weight_fanout  # the trainer's site; children per node of a weight tree
    self._trees: dict[int, dict[int, int | None]] = {}  # version -> {sampler id: parent id, None: the trainer}
    self._cond = threading.Condition()
    self._version = -1  # nothing published yet
    self._next_step = start_step
    self._plans: dict[int, StepPlan] = {}
    self._leases: dict[int, tuple[int, Lease]] = {}  # lease id -> (sampler id, lease)
    self._samplers: dict[int, _Sampler] = {}
    self._lost: dict[int, str] = {}  # ids declared lost -> name
    self._re_leased: dict = {}  # (step, group id) of prompts leased again -> the loss, until delivered
    self._recovered: set = set()  # losses whose prompts were delivered by another sampler
    self._granted: dict[int, set] = {}  # sampler id -> (step, group id) ever leased to it, steps not yet trained
    self._target_instances = config.scheduling.instances
    self._finished = False
    self._next_lease = 0
    self._watchdog: Watchdog | None = None
    self.busy: dict[str, list] = {}  # sampler name -> [(start, end, label)] in epoch seconds
    self.events: list[dict] = []  # samplers joining, leaving, lost; leases given again; in epoch seconds
    self.counters = dict(registered=0, leases=0, reports=0, prompts_submitted=0, samples_generated=0,
                         sampler_wait_s=0.0, samplers_left=0, samplers_lost=0, re_leased_leases=0,
                         re_leased_prompts=0, groups_kept=0, late_samples=0, late_reports=0, rejoin_requests=0,
                         trained_refusals=0, refused_batches=0, prompts_backfilled=0, groups_regenerated=0,
                         partial_samples_handed_back=0)

  # ---- sampler-facing messages ---------------------------------------------------------------
  def register(self, message: Register) -> Registered:
    differing = sorted(k for k in set(self.settings) | set(message.settings)
                       if self.settings.get(k) != message.settings.get(k))
    if differing:
      key = differing[0]
      raise BadMessage(f"sampler {quote(message.name)} runs another configuration than the trainer: {len(differing)} "
                       f"settings differ, first {quote(key)} = {quote(message.settings.get(key))} (sampler) vs "
                       f"{quote(self.settings.get(key))} (trainer); give both the same --config and --set")
    if message.relay:
      try:
        parse_address(message.relay, "Register.relay")
      except ValueError as err:
        raise BadMessage(f"sampler {quote(message.name)}: {err}") from None
    with self._cond:
      sampler_id = secrets.randbits(62)
      while sampler_id in self._samplers or sampler_id in self._lost:
        sampler_id = secrets.randbits(62)
      self.counters["registered"] += 1
      self._samplers[sampler_id] = _Sampler(message.name, self._clock(), site=message.site, relay=message.relay)
      self._event("sampler_joined", sampler=message.name, sampler_id=sampler_id, next_step=self._next_step,
                  site=message.site, relay=message.relay)
      self._cond.notify_all()
    return Registered(sampler_id=sampler_id, start_step=self.start_step, steps=self.config.steps,
                      heartbeat_s=self.heartbeat_s)

  def lease(self, message: LeaseRequest) -> LeaseReply:
    """The next lease of an open step, waiting up to `wait_s` for one to open; finished once the run is over."""
    deadline = time.monotonic() + min(max(message.wait_s, 0.0), MAX_LEASE_WAIT_S)
    with self._cond:
      if message.sampler_id in self._samplers:  # heard from now; not again while the request waits here
        self._samplers[message.sampler_id].last_seen = self._clock()
      while True:
        if self._finished:
          if message.sampler_id in self._samplers:
            self._samplers[message.sampler_id].told_to_stop = True
          self._cond.notify_all()
          return LeaseReply(lease=None, finished=True)
        sampler = self._samplers.get(message.sampler_id)
        if sampler is None:  # lost while this request waited, or never known
          self.counters["rejoin_requests"] += 1
          return LeaseReply(lease=None, finished=False, rejoin=True)
        lease = self._next_lease_of_open_step()
        if lease is not None:
          lease = dataclasses.replace(lease, lease_id=self._next_lease, instances=self._target_instances)
          self._next_lease += 1
          self._leases[lease.lease_id] = (message.sampler_id, lease)
          self._granted.setdefault(message.sampler_id, set()).update((lease.step, g) for g in lease.group_ids)
          sampler.leases.add(lease.lease_id)
          self.counters["leases"] += 1
          return LeaseReply(lease=lease, finished=False)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return LeaseReply(lease=None, finished=False)
        self._cond.wait(remaining)

  def report(self, message: StepReport) -> Ack:
    """Records what a sampler measured for a lease; the step's summary is made once all its leases reported.
    A lost sampler's report is ignored (its lease went to another) and it is told to register again."""
    with self._cond:
      sampler = self._samplers.get(message.sampler_id)
      if sampler is None:
        self.counters["late_reports"] += 1
        return Ack(rejoin=True)
      sampler.last_seen = self._clock()
      owner, lease = self._leases.get(message.lease_id, (None, None))
      if owner != message.sampler_id or lease.step != message.step:
        raise BadMessage(f"sampler {message.sampler_id} reported lease {message.lease_id} of step {message.step}, "
                         f"which it does not hold")
      if len(message.lengths) != len(lease.prompts):
        raise BadMessage(f"report of lease {message.lease_id}: {len(message.lengths)} lengths for "
                         f"{len(lease.prompts)} prompts")
      plan = self._plans[lease.step]
      plan.reports[message.lease_id] = message
      sampler.leases.discard(message.lease_id)
      sampler.wait_s += message.wait_s
      sampler.rss_mb = message.rss_mb
      self.busy.setdefault(sampler.name, []).extend((b, e, f"step {message.step}") for b, e in message.busy)
      self.counters["reports"] += 1
      self.counters["prompts_submitted"] += len(lease.prompts)
      self.counters["samples_generated"] += message.samples
      self.counters["sampler_wait_s"] += message.wait_s
      if len(plan.reports) == plan.leases:
        plan.summary = self._summarise(lease.step, plan)
      self._cond.notify_all()
    return Ack()

  def on_shard(self, sampler_id: int, shard) -> str:
    """Whether to take a `SampleShard` that sampler `sampler_id` delivers: 'accept' (a live sampler), 'late'
    (a lost one: taken, the trainer drops copies it has), 'trained' (its step is trained already: not
    taken, nothing to do) or 'rejoin' (unknown here: refused, register again). A shard that breaks the
    rules is refused with `BadShard` naming the first broken one: one step, whole groups (each sample index
    of a group once), and only groups of leases this sampler was given. Taken groups are remembered until
    their step is summarised, so a lease handed back is cut to the groups still missing."""
    step = int(shard.steps[0])
    if (shard.steps != step).any():
      raise BadShard(f"a shard mixes steps {sorted(set(shard.steps.tolist()))[:4]}; send one step a shard")
    group_size = self.config.group_size
    completion = shard.loss_mask.sum(axis=1)
    lengths = {}
    for g in np.unique(shard.group_ids):
      rows = shard.group_ids == g
      if sorted(shard.sample_indices[rows].tolist()) != list(range(group_size)):
        raise BadShard(f"group {int(g)} of step {step} carries sample indices "
                       f"{quote(sorted(shard.sample_indices[rows].tolist()))}; a shard carries whole groups, "
                       f"indices 0..{group_size - 1} once each")
      lengths[int(g)] = float(completion[rows].mean())
    group_ids = list(lengths)
    with self._cond:
      sampler = self._samplers.get(sampler_id)
      if sampler is None and sampler_id not in self._lost:
        self.counters["rejoin_requests"] += 1
        return "rejoin"
      if step < self._version:  # published version v: steps below v are trained
        self.counters["trained_refusals"] += 1
        return "trained"
      granted = self._granted.get(sampler_id, set())
      foreign = [g for g in group_ids if (step, g) not in granted]
      if foreign:
        name = sampler.name if sampler is not None else self._lost[sampler_id]
        raise BadShard(f"group {foreign[0]} of step {step} was never leased to sampler {quote(name)}")
      if step in self._plans:
        self._plans[step].delivered.update({int(g): float(x) for g, x in lengths.items()})
      if sampler is None:
        self.counters["late_samples"] += len(group_ids) * self.config.group_size
        return "late"
      sampler.last_seen = self._clock()
      losses = {self._re_leased.pop((step, g)) for g in group_ids if (step, g) in self._re_leased}
      for loss in sorted(losses - self._recovered):  # the first delivery of what a loss handed back
        self._recovered.add(loss)
        self._event("re_leased_delivered", sampler=sampler.name, step=step, lost_sampler=loss[1],
                    since_lost_s=round(time.time() - loss[0], 3))
      return "accept"

  def shard_refused(self, reason: str) -> None:
    """The door refused a sample batch (malformed, or outside the sender's leases): an event, a count."""
    with self._cond:
      self.counters["refused_batches"] += 1
      self._event("shard_refused", reason=reason[:300])

  def heartbeat(self, message: Heartbeat) -> HeartbeatReply:
    with self._cond:
      sampler = self._samplers.get(message.sampler_id)
      if sampler is None:
        if not self._finished:
          self.counters["rejoin_requests"] += 1
        return HeartbeatReply(stop=self._finished, rejoin=not self._finished)
      sampler.last_seen = self._clock()
      sampler.told_to_stop |= self._finished
      return HeartbeatReply(stop=self._finished)

  def leave(self, message: Leave) -> Ack:
    """A sampler leaves: leases it has not reported go back to their steps for another sampler, with the
    samples it had begun (partial rollouts), which the next sampler resumes. Partials that are not of this
    sampler's open leases, or longer than a sample may be, refuse the whole message (its leases then go back
    without them when it is declared lost)."""
    with self._cond:
      if message.sampler_id in self._samplers:
        held = {g for lease_id in self._samplers[message.sampler_id].leases for g in self._leases[lease_id][1].group_ids}
        problem = partial_problem(self.config, held, message.partials)
        if problem:
          raise BadMessage(f"sampler {message.sampler_id} hands back {problem}")
        self._drop(message.sampler_id, lost=False, partials=message.partials)
    return Ack()

  # ---- faults --------------------------------------------------------------------------------
  def expire_silent(self) -> list[str]:
    """Declares lost every sampler silent for more than `lease_timeout_s`; returns their names."""
    with self._cond:
      now = self._clock()
      silent = [i for i, s in self._samplers.items() if now - s.last_seen > self.lease_timeout_s]
      return [self._drop(i, lost=True) for i in silent]

  def start_watchdog(self, period: float | None = None) -> None:
    """Checks for silent samplers every `period` s (default: a quarter of the lease timeout) on a thread of
    its own; a late tick (this process was paused) gives every sampler a fresh start instead."""
    self._watchdog = Watchdog(period or self.lease_timeout_s / 4, self.expire_silent, self._paused, self._clock)
    self._watchdog.start()

  def _paused(self, seconds: float) -> None:
    with self._cond:
      now = self._clock()
      for sampler in self._samplers.values():
        sampler.last_seen = now
      self._event("trainer_paused", seconds=round(seconds, 2))

  def close(self) -> None:
    """Stops the watchdog."""
    if self._watchdog is not None:
      self._watchdog.close()

  def _drop(self, sampler_id: int, *, lost: bool, partials: tuple[Partial, ...] = ()) -> str:
    """Removes a sampler (lock held); its unreported leases go back to the front of their steps, with the
    `partials` of their groups not yet delivered."""
    sampler = self._samplers.pop(sampler_id)
    leases = sorted(sampler.leases)
    loss = (time.time(), sampler.name)
    for lease_id in reversed(leases):
      _, lease = self._leases.pop(lease_id)
      plan = self._plans[lease.step]
      missing = [i for i, g in enumerate(lease.group_ids) if g not in plan.delivered]
      self.counters["groups_kept"] += len(lease.group_ids) - len(missing)
      if not missing:  # every group arrived; only the report is lost
        plan.leases -= 1
        if len(plan.reports) == plan.leases:
          plan.summary = self._summarise(lease.step, plan)
        continue
      pick = lambda values: tuple(values[i] for i in missing) if values else ()  # noqa: E731
      begun = tuple(p for p in partials if p.group_id in {lease.group_ids[i] for i in missing})
      plan.unleased.insert(0, dataclasses.replace(lease, group_ids=pick(lease.group_ids), prompts=pick(lease.prompts),
                                                  predicted_lengths=pick(lease.predicted_lengths), partials=begun,
                                                  rows=pick(lease.rows)))
      self.counters["partial_samples_handed_back"] += len(begun)
      if lost:
        self._re_leased.update({(lease.step, lease.group_ids[i]): loss for i in missing})
        self.counters["re_leased_prompts"] += len(missing)
    if lost:
      self._lost[sampler_id] = sampler.name
      self.counters["samplers_lost"] += 1
      self.counters["re_leased_leases"] += len(leases)
    else:
      self.counters["samplers_left"] += 1
    self._event("sampler_lost" if lost else "sampler_left", sampler=sampler.name, sampler_id=sampler_id,
                leases_returned=len(leases))
    self._cond.notify_all()
    return sampler.name

  def _event(self, kind: str, **fields) -> None:
    event = dict(event=kind, t=time.time(), **fields)
    self.events.append(event)
    if self._on_event is not None:
      self._on_event(event)

  def weight_source(self, sampler_id: int, version: int) -> str:
    """Where `sampler_id` fetches `version` from: its parent's relay address in the version's broadcast tree
    (`scheduling.broadcast`, made at the version's first query from the samplers then registered, and put in
    the timeline as a `broadcast_tree` event), or "" for the trainer (not in that tree, or its parent is gone)."""
    with self._cond:
      if version not in self._trees:
        members = [TreeMember(i, s.site, bool(s.relay)) for i, s in self._samplers.items()]
        previous = self._trees[max(self._trees)] if self._trees else None
        self._trees[version] = tree = broadcast_tree(members, self.site, self.weight_fanout)
        for old in sorted(self._trees)[:-4]:
          del self._trees[old]
        if any(parent is not None for parent in tree.values()):  # relays at work: the timeline shows the tree
          names = {i: self._samplers[i].name for i in tree}
          self._event("broadcast_tree", version=version, parents={names[c]: names.get(p) for c, p in tree.items()},
                      drawing=draw_tree(tree, names, {i: self._samplers[i].site for i in tree}),
                      unchanged=tree == previous)
      parent = self._trees[version].get(sampler_id)
      holder = self._samplers.get(parent) if parent is not None else None
      return holder.relay if holder is not None else ""

  # ---- trainer-facing ------------------------------------------------------------------------
  def published(self, version: int) -> None:
    """The trainer has published weights of `version`: steps up to version + max_lag may open."""
    with self._cond:
      self._version = max(self._version, version)
      for sampler_id, granted in list(self._granted.items()):
        granted.difference_update({k for k in granted if k[0] < self._version})
        if not granted and sampler_id not in self._samplers:
          del self._granted[sampler_id]
      self._cond.notify_all()

  def backfill(self, step: int, filtered: list[int]) -> int:
    """Dynamic sampling: the trainer did not train the groups `filtered` of `step` (their rewards were all
    equal); leases as many more prompts of the step as its backfill bound still allows, before any later
    step's. Returns how many (an event records the filtered groups)."""
    with self._cond:
      plan = self._plans.get(step)
      count = 0 if plan is None else backfill_count(self.config, plan.backfilled, len(filtered))
      self._event("groups_filtered", step=step, group_ids=list(filtered), backfilled=count)
      if count <= 0:
        return 0
      drawn = backfill_prompts(self.config, self.task, step, plan.backfilled, count)
      ids = step_group_ids(self.config, step)[1][plan.backfilled:plan.backfilled + count]
      self._hand_out(step, plan, ids, drawn)
      plan.backfilled += count
      self.counters["prompts_backfilled"] += count
      return count

  def regenerate(self, step: int, group_ids: list[int]) -> None:
    """The trainer refused the groups `group_ids` of `step` (a token older than the staleness bound): they are
    leased again, to be generated afresh."""
    with self._cond:
      plan = self._plans.get(step)
      if plan is None:
        return
      planned, extra = step_group_ids(self.config, step)
      drawn = [(plan.prompts[g - planned.start], plan.rows[g - planned.start]) if g in planned else
               backfill_prompts(self.config, self.task, step, g - extra.start, 1)[0] for g in group_ids]
      for g in group_ids:
        plan.delivered.pop(g, None)
      self._hand_out(step, plan, group_ids, drawn)
      self.counters["groups_regenerated"] += len(group_ids)
      self._event("groups_regenerated", step=step, group_ids=list(group_ids))

  def _hand_out(self, step: int, plan: StepPlan, group_ids, drawn) -> None:
    """One more lease of `step` (lock held) for `drawn` (prompt, row) pairs, taken before any later step's."""
    plan.unleased.append(Lease(lease_id=-1, step=step, group_ids=tuple(int(g) for g in group_ids),
                               prompts=tuple(p for p, _ in drawn), predicted_lengths=(), length_quantiles=(),
                               min_version=self._min_version(step), instances=self._target_instances,
                               rows=tuple(r for _, r in drawn)))
    plan.leases += 1
    plan.summary = None
    self._cond.notify_all()

  def set_target_instances(self, instances: int) -> None:
    with self._cond:
      self._target_instances = instances

  def step_trained(self, step: int, train_s: float) -> dict:
    """The trainer has trained `step` in `train_s` s: sets the replica target of the next leases by the elastic
    rule (per sampler process: each runs its own replicas) and returns the step's summary."""
    summary = self.step_summary(step)
    per_process = max(1, round(summary["sampler_instances"] / max(1, summary.get("sampler_processes", 1))))
    self.set_target_instances(self.config.scheduling.replica_target(per_process, summary["generation_s"], train_s))
    return summary

  def step_summary(self, step: int, timeout: float | None = None) -> dict:
    """generation_s, sampler_instances and the ranker's figures of `step`, once all its leases reported."""
    timeout = self.summary_timeout_s if timeout is None else timeout
    with self._cond:
      if not self._cond.wait_for(lambda: step in self._plans and self._plans[step].summary is not None, timeout):
        raise TimeoutError(f"the samplers' reports of step {step} did not arrive within {timeout} s")
      plan = self._plans.pop(step)
      for lease_id in plan.reports:  # kept until now: a lease added late (a backfill) summarises the step again
        self._leases.pop(lease_id, None)
      return dict(plan.summary)

  def silent_s(self) -> float | None:
    """Seconds since any registered sampler was last heard from (None: none registered)."""
    with self._cond:
      if not self._samplers:
        return None
      return self._clock() - max(s.last_seen for s in self._samplers.values())

  def sampler_wait_s(self) -> float:
    """Seconds the samplers waited for leases and weights, per sampler on average."""
    with self._cond:
      return self.counters["sampler_wait_s"] / max(1, self.counters["registered"])

  def finish(self) -> None:
    """No more leases: samplers are told the run is over at their next lease request or heartbeat."""
    with self._cond:
      self._finished = True
      self._cond.notify_all()

  def wait_samplers_left(self, timeout: float) -> bool:
    """After `finish`: waits until every registered sampler has left."""
    with self._cond:
      return self._cond.wait_for(lambda: not self._samplers, timeout)

  # ---- planning ------------------------------------------------------------------------------
  def _next_lease_of_open_step(self) -> Lease | None:
    for step in sorted(self._plans):
      if self._plans[step].unleased:
        return self._plans[step].unleased.pop(0)
    step = self._next_step
    if step >= self.config.steps or self._version < self._min_version(step):
      return None
    self._plans[step] = self._plan(step)
    self._next_step += 1
    return self._plans[step].unleased.pop(0)

  def _min_version(self, step: int) -> int:
    return min_version(self.start_step, step, self.spec.max_lag)

  def _plan(self, step: int) -> StepPlan:
    config = self.config
    drawn = step_prompts(config, self.task, step)
    prompts, rows = [p for p, _ in drawn], [r for _, r in drawn]
    encoded = [prompt_tokens(self.task, self.tokenizer, p) for p in prompts]
    scores, predicted, quantiles, history = None, (), (), ()
    if self.ranker is not None:
      history = self.ranker.history_lengths
      scores = self.ranker.scores(encoded)
      predicted = tuple(float(x) for x in lengths_from_scores(scores, history, default=config.max_new_tokens / 2))
      if history.size:
        quantiles = tuple(float(x) for x in np.percentile(history, np.arange(101)))
    cuts = cut_prompts(config, step, predicted, history, parts=len(self._samplers))
    leases = step_leases(config, step, prompts, rows, cuts, predicted, quantiles, self._min_version(step),
                         self._target_instances)
    return StepPlan(prompts, rows, encoded, scores, leases, len(leases))

  def _summarise(self, step: int, plan: StepPlan) -> dict:
    reports = list(plan.reports.values())
    by_group = dict(plan.delivered)  # groups of a lease handed back: their length as delivered
    by_group.update({g: length for r in reports for g, length in zip(self._leases[r.lease_id][1].group_ids, r.lengths)})
    planned = step_group_ids(self.config, step)[0]  # the ranker scored these; backfilled ones are apart
    lengths = np.asarray([by_group[k] for k in sorted(by_group) if k in planned])
    out = dict(generation_s=max((r.generation_s for r in reports), default=0.0),
               sampler_instances=sum({r.sampler_id: r.instances for r in reports}.values()),
               sampler_processes=len({r.sampler_id for r in reports}),
               sampler_rss_mb=max((r.rss_mb for r in reports), default=0.0))
    if self.ranker is None:
      return out
    if len(lengths) >= 2:
      out.update({f"ranker_{k}": v for k, v in ranking_metrics(plan.scores, lengths).items()})
    if not plan.observed:  # once a step, also when a late lease (a backfill) summarises it again
      self.ranker.observe(plan.encoded, lengths)
      plan.observed = True
    out["ranker_train_steps"] = self.ranker.counters["train_steps"]
    return out
