"""The sampler worker: generates the prompts of leased steps on the sampler mesh and streams each finished
group, scored by the configured rewards (`RewardScorer`, off the decode loop), to the trainer as a `SampleShard`.

It owns its engines (one per instance sub-mesh and compiled slot count), the continuous-batching driver,
admission and the instance count; it reaches the rest of the run only through three interfaces: a control
channel (register / lease / report / leave: the `Controller` itself in one process, its Flight client
across processes), a sample transport (`put`) and a weight source (`latest` / `wait_for`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np

from streamrl_jax.envs import make_tools
from streamrl_jax.models import ModelConfig
from streamrl_jax.messages import (SAMPLER_PHASES, Lease, LeaseReply, LeaseRequest, Leave, Register, RejoinRequired,
                                   StepReport, WeightUpdate, row_step)
from streamrl_jax.phase_clock import PhaseClock
from streamrl_jax.agents.rollouts import Failure, sampler_server
from streamrl_jax.pipeline.sampler.engines import InstanceEngines, submit_lease
from streamrl_jax.pipeline.sampler.episodes import LeaseEpisodes
from streamrl_jax.pipeline.sampler.groups import GroupCollector
from streamrl_jax.resources import resident_mb
from streamrl_jax.rewards import RewardScorer
from streamrl_jax.run_shape import RunShape
from streamrl_jax.sampling import SamplerConfig, StreamingSampler
from streamrl_jax.scheduling import SchedulingConfig
from streamrl_jax.tasks.rows import Row, question, verifier
from streamrl_jax.types import Rollout, Sample

_log = logging.getLogger(__name__)

LEASE_POLL_S = 5.0
SCORE_WAIT_S = 0.05  # nothing to decode, rewards still running: how long to wait for one before looking again
LEASE_REPOLL_S = 0.05  # in flight: how often a busy sampler asks whether the next lease is open
PARTIAL_TOKENS = 60_000  # the most tokens of begun samples a leaving sampler hands back (a Leave stays < 2 MB)
SERVING_LEASE_POLL_S = 0.2  # idle with a server: a shorter long poll, so served requests wait no longer for the loop
SERVING_IDLE_S = 0.02  # a server's requests or episodes pending, nothing to decode: the wait for the next request


@dataclasses.dataclass(frozen=True)
class SamplerRole:
  """How a sampler shows itself: the `name` and the run's `settings` it registers with; `serve` (a `ServeConfig`):
  an OpenAI-compatible server on its engine too (`serving`), with mutual TLS by `serve_tls`."""

  name: str = "sampler"
  settings: dict | None = None
  serve: object = None
  serve_tls: object = None


@dataclasses.dataclass(frozen=True)
class SamplerSetup:
  """What a sampler worker is built from beside its model: its side's config, the dispatch policy, the run's shape."""

  sampler: SamplerConfig  # the engine, in flight, the rewards, the environment or agent program
  scheduling: SchedulingConfig  # how requests are dispatched and admitted, and the engine instances
  shape: RunShape  # the run's mode, group size, lengths, sampling and seed


@dataclasses.dataclass
class _LeaseRun:
  """A lease being generated: its groups' collector, and what its report will say."""

  lease: Lease
  collector: GroupCollector
  wait_s: float  # waiting for the lease and its weights
  begin: float
  begin_epoch: float
  lengths: np.ndarray  # mean completion tokens per prompt, in lease order
  left: int  # samples not yet out (finished, scored and sent with their group)
  template_prefix_mismatch: int = 0  # agent turns whose template rendered the episode's sampled text anew
  index_of: dict[int, int] = dataclasses.field(init=False)  # group id -> place in the lease

  def __post_init__(self):
    self.index_of = {g: i for i, g in enumerate(self.lease.group_ids)}

  def report(self, sampler_id: int, group_size: int, instances: int, phase_s: tuple) -> StepReport:
    """The lease's step report, once its last group is out."""
    lease = self.lease
    return StepReport(sampler_id=sampler_id, lease_id=lease.lease_id, step=lease.step,
                      generation_s=time.perf_counter() - self.begin, lengths=tuple(float(x) for x in self.lengths),
                      wait_s=self.wait_s, samples=len(lease.prompts) * group_size, instances=instances,
                      busy=((self.begin_epoch, time.time()),), rss_mb=resident_mb(), phase_s=phase_s,
                      template_prefix_mismatch=self.template_prefix_mismatch)


class SamplerWorker:
  """Leases in, shards and step reports out."""

  def __init__(self, setup: SamplerSetup, graphdef, model_config: ModelConfig, tokenizer, task, mesh, *,
               role: SamplerRole = SamplerRole()):
    """With an agent program (`EnvConfig.agent`) a server is started on a free local port anyway, for the agents."""
    sampler = self.sampler_config = setup.sampler  # (`self.sampler`: the streaming sampler, once weights came)
    self.shape, self.spec, self.tokenizer, self.task = setup.shape, setup.shape.spec, tokenizer, task
    self.name, self.settings = role.name, dict(role.settings or {})
    self.engines = InstanceEngines(setup.scheduling, sampler.engine, graphdef, model_config, mesh)
    self.admission = setup.scheduling.scheduling_policy.admission
    self.scorer = RewardScorer(sampler.reward, builtin=verifier(task))
    self.bridge, self.server = sampler_server(sampler, role.serve, tokenizer, role.serve_tls, role.name)
    self.episodes = LeaseEpisodes(sampler.env, setup.shape, task, role.name)
    self.phase_clock = PhaseClock(SAMPLER_PHASES)  # the serving thread's seconds, by phase: each report carries them
    self.reset()

  # ---- the loop ------------------------------------------------------------------------------
  def register(self, control, *, site: str = "", relay: str = "") -> int:
    """Joins the run (from datacenter `site`, serving weights at `relay` when given); returns this sampler's id."""
    registered = control.register(Register(name=self.name, settings=self.settings, site=site, relay=relay))
    self.sampler_id, self.data_endpoints = registered.sampler_id, registered.data_endpoints
    return self.sampler_id

  def run(self, control, samples, weights, stop: threading.Event) -> None:
    self.register(control)
    self.serve(control, samples, weights, stop)

  def serve(self, control, samples, weights, stop: threading.Event, rejoin: threading.Event | None = None) -> str:
    """Generates leases until the controller says the run is over ('finished'), `stop` is set ('stopped'),
    or the controller no longer knows this sampler ('rejoin': the leases in hand are dropped, the caller
    registers again). `rejoin`, when set by another thread (a heartbeat's reply), also ends it.

    One lease at a time, or with `in_flight` a second one as soon as every request of the first is admitted:
    its requests fill the slots that the first one's long tail leaves free, and the weights it needs are
    taken between two decode calls, without draining the rows in flight."""
    rejoin = rejoin or threading.Event()
    runs: dict[int, _LeaseRun] = {}
    held, waited_since, polled = None, time.perf_counter(), 0.0
    outcome = "stopped"
    try:
      while not stop.is_set() and not rejoin.is_set():
        busy = bool(runs)
        if held is None and self._wants_lease(runs, polled):
          polled = time.perf_counter()
          reply = self._ask_lease(control, busy)
          if reply.finished:
            outcome = "finished"
            break
          held = reply.lease
        if held is not None:
          update = self._lease_weights(held, busy, weights, stop, rejoin)
          if update is None and not busy:
            break  # stopped, or told to rejoin, while waiting for the weights
          if update is not None:
            with self.phase_clock.phase("host"):
              runs[held.lease_id] = self._start(held, time.perf_counter() - waited_since, samples)
            held = None
        if not runs and not self._serving():
          continue
        self._decode(runs, samples, weights)
        self._send_scored(runs, samples)
        with self.phase_clock.phase("report"):
          reported = self._report_finished(control, runs)
        if reported:
          waited_since = time.perf_counter()
      if rejoin.is_set():
        raise RejoinRequired(f"{self.name}: the trainer does not know sampler {self.sampler_id}")
    except RejoinRequired:
      self.reset()
      return "rejoin"
    finally:
      self.scorer.close()  # its workers start again with the next session
      self.episodes.close()
    self._leave(control, runs, outcome)
    return outcome

  def _ask_lease(self, control, busy: bool) -> LeaseReply:
    """The controller's reply to a lease request: long-polled when idle; RejoinRequired when it does not know us."""
    idle_wait = SERVING_LEASE_POLL_S if self.server is not None else LEASE_POLL_S
    with self.phase_clock.phase("lease_wait"):
      reply = control.lease(LeaseRequest(self.sampler_id, wait_s=0.0 if busy or self._serving() else idle_wait))
    if not reply.finished and reply.rejoin:
      raise RejoinRequired(f"{self.name}: the trainer does not know sampler {self.sampler_id}")
    return reply

  def _leave(self, control, runs: dict, outcome: str) -> None:
    """Leaves the run, handing back what a stopped sampler has begun of its leases."""
    try:
      served = self.bridge.request_ids if self.bridge is not None else frozenset()
      partials = _partials(self.sampler, runs, bool(self.sampler_config.env.agent),
                           served) if outcome == "stopped" else ()
      control.leave(Leave(self.sampler_id, partials=partials))
    except ConnectionError:  # the trainer is gone already: nothing to hand back
      pass

  def close(self) -> None:
    """Stops the server (its requests refused) and the agent workers; the end of the sampler's program."""
    self.episodes.close()
    if self.bridge is not None:
      self.bridge.close(self.sampler, "the sampler has stopped")
    if self.server is not None:
      self.server.stop()
      self.server = None

  def _serving(self) -> bool:
    """Whether served requests wait or run on this sampler (its engine decodes for them between leases)."""
    return self.bridge is not None and self.sampler is not None and (self.bridge.busy or self.sampler.has_work())

  def _lease_weights(self, lease: Lease, busy: bool, weights, stop, rejoin) -> WeightUpdate | None:
    """Weights new enough for `lease`, taken: while rows run, the newest if it is (else None: decode meanwhile);
    idle, waited for (None: stopped or told to rejoin first)."""
    with self.phase_clock.phase("weight_receive"):
      if not busy:
        update = _wait_for_weights(weights, lease.min_version, stop, rejoin)
      else:
        update = weights.latest()
        update = update if update is not None and update.version >= lease.min_version else None
      if update is not None:
        self._take_weights(update)
    return update

  def _report_finished(self, control, runs: dict) -> bool:
    """Reports every lease whose groups are all out and drops it; returns whether any was."""
    done = [r for r in runs.values() if r.left == 0]
    for run in done:
      self._report(control, run)
      del runs[run.lease.lease_id]
    return bool(done)

  def _wants_lease(self, runs: dict, polled: float) -> bool:
    """Whether to ask for a lease now: when idle; with `in_flight`, also when the one lease in hand has every
    request admitted (asked at most every LEASE_REPOLL_S while rows run)."""
    if not runs:
      return True
    return (self.sampler_config.in_flight and len(runs) == 1 and self.sampler.num_pending == 0
            and time.perf_counter() - polled >= LEASE_REPOLL_S)

  def reset(self) -> None:
    """No requests, weights or id (kept: the compiled engines): the state of a fresh start or a rejoin."""
    self.sampler: StreamingSampler | None = None
    self.sampler_id: int | None = None
    self.data_endpoints: tuple[str, ...] = ()  # the trainer processes' sample doors (Registered)
    self.engines.reset()
    self.scorer.close()  # nothing of the leases dropped is scored
    self.episodes.close()  # the episodes of the leases dropped are not wanted
    if self.bridge is not None:
      self.bridge.refuse_all(None, "the sampler is joining the run again; retry")
      self.bridge.version = -1

  def _take_weights(self, update: WeightUpdate) -> None:
    if self.sampler is None:
      self.sampler = StreamingSampler(self.engines.first(), update.params, version=update.version,
                                      admission=self.admission, seed=self.shape.seed,
                                      tools=make_tools(self.sampler_config.env, self.tokenizer), clock=self.phase_clock)
      if self.bridge is not None:
        self.bridge.version = update.version
    elif update.version > self.sampler.version:
      self.sampler.update_params(update.params, update.version,
                                 recompute=self.sampler_config.in_flight_cache == "recompute")

  def _start(self, lease: Lease, wait_s: float, samples) -> _LeaseRun:
    """Submits a lease's requests (group_size per prompt; samples begun elsewhere resume after their tokens,
    finished ones are scored as they are) and returns what tracks it until it is reported."""
    collector = GroupCollector(self.shape.group_size, self.shape.longest)
    rows = [Row.from_json(r) for r in lease.rows] if lease.rows else [Row()] * len(lease.prompts)
    for group_id, prompt, row in zip(lease.group_ids, lease.prompts, rows):
      collector.expect(group_id, prompt, lease.step, row)
    self.engines.target = lease.instances
    self.engines.apply_elastic(self.sampler)
    run = _LeaseRun(lease, collector, wait_s, time.perf_counter(), time.time(),
                    np.zeros(len(lease.prompts)), len(lease.prompts) * self.shape.group_size)
    if len(lease.prompt_tokens) != len(lease.prompts):
      raise ValueError(f"lease {lease.lease_id} carries {len(lease.prompt_tokens)} prompts' token ids for "
                       f"{len(lease.prompts)} prompts: a controller of another streamrl_jax version?")
    if self.sampler_config.env.agent:
      self.episodes.start(lease, rows, self.server)
    else:
      submit_lease(self.shape, self.sampler, self.engines, lease, lease.prompt_tokens, self.tokenizer.stop_ids)
    for rollout in (p for p in lease.partials if p.finished):
      i = run.index_of[rollout.group_id]
      self._collect(run, Sample.of_rollout(rollout, lease.prompt_tokens[i], self.tokenizer.stop_ids), samples)
    return run

  def _collect(self, run: _LeaseRun, sample: Sample, samples, text: str | None = None,
               failure: Failure | None = None) -> None:
    """A finished sample into its lease's collector, and to the scorer (`text`: what the reward functions score,
    default its completion's text). An agent episode that failed (`failure`: why) is scored 0 and counted."""
    run.lengths[run.index_of[sample.group_id]] += sample.num_tokens / self.shape.group_size
    group = run.collector.add(sample)
    where = (f"{group.row.where or 'prompt ' + repr(group.prompt[:40])}, step {row_step(run.lease.step)}, group "
             f"{sample.group_id}, sample {sample.sample_index}")
    key = (run.lease.lease_id, sample.group_id, sample.sample_index)
    if failure is not None:
      self.episodes.failed(key, failure, where, len(self.scorer.names))
      return
    with self.phase_clock.phase("reward"):
      text = self.tokenizer.decode(sample.completion_tokens) if text is None else text
      self.scorer.submit(key, question(self.task, group.prompt), text, group.row.fields, where)

  def _send_scored(self, runs: dict, samples) -> None:
    """Each scored sample to its collector; a group whole and scored goes out. With nothing to decode, waits a
    moment for a reward first (rather than spin)."""
    with self.phase_clock.phase("reward"):
      if self.scorer.pending and (self.sampler is None or not self.sampler.has_work()):
        self.scorer.wait(SCORE_WAIT_S)
      scored = self.scorer.done() + self.episodes.take_scores()
    for (lease_id, group_id, index), score in scored:
      run = runs[lease_id]
      shard = run.collector.scored(group_id, index, score)
      if shard is not None:
        with self.phase_clock.phase("send"):
          samples.put(shard)
        run.left -= self.shape.group_size

  def _decode(self, runs: dict, samples, weights) -> None:
    """One driver step: newer weights first (async: between decode calls), then each finished sample to its
    lease's collector, and each complete group out."""
    sampler = self.sampler
    self.engines.apply_elastic(sampler)
    if self.spec.mid_step_swap:
      with self.phase_clock.phase("weight_receive"):
        latest = weights.latest()
        if latest is not None and latest.version > sampler.version:
          sampler.update_params(latest.params, latest.version,
                                recompute=self.sampler_config.in_flight_cache == "recompute")
    bridge = self.bridge
    if bridge is not None:
      bridge.pump(sampler)
    with self.phase_clock.phase("host"):  # less its prefill and decode waits (the sampler's own phases)
      finished = sampler.step() if bridge is None or sampler.has_work() else []
    if bridge is not None:
      finished = bridge.deliver(sampler, finished)  # the served requests' samples go to their clients
    if finished:
      owner = {g: run for run in runs.values() for g in run.lease.group_ids}
      for sample in finished:
        self._collect(owner[sample.group_id], sample, samples)
    if self.episodes.agents is not None:
      for run, sample, text, failure in self.episodes.finished(runs, self.tokenizer.stop_ids[0], sampler.version):
        self._collect(run, sample, samples, text=text, failure=failure)
    if bridge is not None and not sampler.has_work() and not self.scorer.pending:
      bridge.wait(SERVING_IDLE_S)  # agents or clients thinking: wake at their next request

  def _report(self, control, run: _LeaseRun) -> None:
    """The lease's step report, once its last group is out."""
    reply = control.report(run.report(self.sampler_id, self.shape.group_size, len(self.sampler.instance_ids),
                                      tuple(self.phase_clock.take().values())))
    if reply.rejoin:
      raise RejoinRequired(f"{self.name}: the trainer took lease {run.lease.lease_id} from sampler {self.sampler_id}")


def _wait_for_weights(weights, version: int, stop: threading.Event, rejoin: threading.Event) -> WeightUpdate | None:
  """Weights of `version` or newer, waited for (None: stopped or told to rejoin first)."""
  while not stop.is_set() and not rejoin.is_set():
    try:
      return weights.wait_for(version, timeout=1.0)
    except TimeoutError:
      continue
  return None


def _partials(sampler, runs: dict, agents: bool = False, served: frozenset = frozenset()) -> tuple[Rollout, ...]:
  """What a `StreamingSampler` (None: none started) has begun of the leases in hand, to hand back as it leaves:
  each running or preempted request's tokens so far, and each finished sample of a group not yet whole (within
  PARTIAL_TOKENS). Agent episodes are not handed over: the next sampler plays them again; nor are served requests
  (`served`: their request ids), which are no lease's."""
  if sampler is None or agents:
    return ()
  out, budget = [], PARTIAL_TOKENS
  leased = {g for run in runs.values() for g in run.lease.group_ids}
  for request, rollout in sampler.in_flight_progress():
    if request.request_id in served or rollout.group_id not in leased:
      continue
    if rollout.completion_tokens and len(rollout.completion_tokens) <= budget:
      out.append(rollout)
      budget -= len(rollout.completion_tokens)
  for run in runs.values():
    for sample in run.collector.held():
      if sample.env_reward:
        continue  # an episode's environment reward is not carried: it is sampled again
      if sample.num_tokens <= budget:
        out.append(sample.rollout())
        budget -= sample.num_tokens
  return tuple(out)
