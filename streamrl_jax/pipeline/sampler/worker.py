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
from streamrl_jax.meshes import instance_meshes
from streamrl_jax.messages import (SAMPLER_PHASES, Lease, LeaseRequest, Leave, Register, RejoinRequired,
                                   StepReport, WeightUpdate)
from streamrl_jax.phase_clock import PhaseClock
from streamrl_jax.agents.rollouts import (AgentRollouts, episode_sample, failure_score, sampler_server,
                                                  scored_text)
from streamrl_jax.pipeline.sampler.groups import GroupCollector
from streamrl_jax.resources import resident_mb
from streamrl_jax.rewards import RewardScorer
from streamrl_jax.rewards.scorer import RewardError
from streamrl_jax.sampling import DecodeEngine, StreamingSampler, make_engine
from streamrl_jax.scheduling import dispatch_requests, engine_slots
from streamrl_jax.tasks.rows import Row, question, verifier
from streamrl_jax.types import Rollout, Sample, SamplingParams

_log = logging.getLogger(__name__)

LEASE_POLL_S = 5.0
SCORE_WAIT_S = 0.05  # nothing to decode, rewards still running: how long to wait for one before looking again
LEASE_REPOLL_S = 0.05  # in flight: how often a busy sampler asks whether the next lease is open
PARTIAL_TOKENS = 60_000  # the most tokens of begun samples a leaving sampler hands back (a Leave stays < 2 MB)
SERVING_LEASE_POLL_S = 0.2  # idle with a server: a shorter long poll, so served requests wait no longer for the loop
SERVING_IDLE_S = 0.02  # a server's requests or episodes pending, nothing to decode: the wait for the next request
AGENT_FAILURES_SHOWN = 3  # failed episodes named in the log (the rest are counted)


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
  index_of: dict[int, int] = dataclasses.field(init=False)  # group id -> place in the lease

  def __post_init__(self):
    self.index_of = {g: i for i, g in enumerate(self.lease.group_ids)}


class SamplerWorker:
  """Leases in, shards and step reports out."""

  def __init__(self, config, graphdef, model_config, tokenizer, task, mesh, *, name: str = "sampler",
               settings: dict | None = None, serve=None, serve_tls=None):
    """`serve` (a `ServeConfig`): also an OpenAI-compatible server on this sampler's engine (`serving`); with an
    agent program (`EnvConfig.agent`) one is started on a free local port anyway, for the agents."""
    self.config, self.spec, self.tokenizer, self.task = config, config.spec, tokenizer, task
    self.name, self.settings = name, dict(settings or {})
    self._graphdef, self._model_config = graphdef, model_config
    sched = config.scheduling
    self.instance_meshes = instance_meshes(mesh, sched.instance_limit)
    self._engines: dict[tuple[int, int], DecodeEngine] = {}
    self.admission = sched.scheduling_policy.admission
    self.scorer = RewardScorer(config.sampler.reward, builtin=verifier(task))
    self.bridge, self.server = sampler_server(config, serve, tokenizer, serve_tls, name)
    self.agents = None
    self._agent_scores: list = []  # (scorer key, Score) of failed episodes, sent out with the scored samples
    self.phase_clock = PhaseClock(SAMPLER_PHASES)  # the serving thread's seconds, by phase: each report carries them
    self.reset()

  def engine_for(self, mesh_index: int, slots: int | None = None) -> DecodeEngine:
    """The engine of instance mesh `mesh_index` compiled for `slots` (default: EngineConfig.num_slots)."""
    slots = slots or self.config.sampler.engine.num_slots
    if (mesh_index, slots) not in self._engines:
      engine_config = dataclasses.replace(self.config.sampler.engine, num_slots=slots)
      self._engines[(mesh_index, slots)] = make_engine(self._graphdef, self._model_config, engine_config,
                                                       self.instance_meshes[mesh_index])
    return self._engines[(mesh_index, slots)]

  # ---- the loop ------------------------------------------------------------------------------
  def register(self, control, *, site: str = "", relay: str = "") -> int:
    """Joins the run (from datacenter `site`, serving weights at `relay` when given); returns this sampler's id."""
    self.sampler_id = control.register(Register(name=self.name, settings=self.settings, site=site,
                                                 relay=relay)).sampler_id
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
          idle_wait = SERVING_LEASE_POLL_S if self.server is not None else LEASE_POLL_S
          with self.phase_clock.phase("lease_wait"):
            reply = control.lease(LeaseRequest(self.sampler_id, wait_s=0.0 if busy or self._serving() else idle_wait))
          if reply.finished:
            outcome = "finished"
            break
          if reply.rejoin:
            raise RejoinRequired(f"{self.name}: the trainer does not know sampler {self.sampler_id}")
          held = reply.lease
        if held is not None:
          with self.phase_clock.phase("weight_receive"):
            update = self._lease_weights(held, busy, weights, stop, rejoin)
            if update is not None:
              self._take_weights(update)
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
      if self.agents is not None:
        self.agents.close()
        self.agents = None
    try:
      served = self.bridge.request_ids if self.bridge is not None else frozenset()
      partials = _partials(self.sampler, runs, bool(self.config.sampler.env.agent), served) if outcome == "stopped" else ()
      control.leave(Leave(self.sampler_id, partials=partials))
    except ConnectionError:  # the trainer is gone already: nothing to hand back
      pass
    return outcome

  def close(self) -> None:
    """Stops the server (its requests refused) and the agent workers; the end of the sampler's program."""
    if self.agents is not None:
      self.agents.close()
      self.agents = None
    if self.bridge is not None:
      self.bridge.close(self.sampler, "the sampler has stopped")
    if self.server is not None:
      self.server.stop()
      self.server = None

  def _serving(self) -> bool:
    """Whether served requests wait or run on this sampler (its engine decodes for them between leases)."""
    return self.bridge is not None and self.sampler is not None and (self.bridge.busy or self.sampler.has_work())

  def _lease_weights(self, lease: Lease, busy: bool, weights, stop, rejoin):
    """Weights new enough for `lease`: while rows run, the newest if it is (else None: decode meanwhile);
    idle, waited for (None: stopped or told to rejoin first)."""
    if not busy:
      return self._wait_for_weights(weights, lease.min_version, stop, rejoin)
    update = weights.latest()
    return update if update is not None and update.version >= lease.min_version else None

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
    return (self.config.sampler.in_flight and len(runs) == 1 and self.sampler.num_pending == 0
            and time.perf_counter() - polled >= LEASE_REPOLL_S)

  def reset(self) -> None:
    """No requests, weights or id (kept: the compiled engines): the state of a fresh start or a rejoin."""
    sched = self.config.scheduling
    self.sampler: StreamingSampler | None = None
    self.mesh_of: dict[int, int] = {}  # sampler instance id -> instance mesh index
    self.sampler_id: int | None = None
    self.spare_meshes = list(range(sched.instances, sched.instance_limit))[::-1]  # instances join in mesh order
    self.target_instances = sched.instances
    self.scorer.close()  # nothing of the leases dropped is scored
    if self.agents is not None:
      self.agents.close()  # the episodes of the leases dropped are not wanted
      self.agents = None
    if self.bridge is not None:
      self.bridge.refuse_all(None, "the sampler is joining the run again; retry")
      self.bridge.version = -1

  @staticmethod
  def _wait_for_weights(weights, version: int, stop: threading.Event, rejoin: threading.Event) -> WeightUpdate | None:
    while not stop.is_set() and not rejoin.is_set():
      try:
        return weights.wait_for(version, timeout=1.0)
      except TimeoutError:
        continue
    return None

  def _take_weights(self, update: WeightUpdate) -> None:
    if self.sampler is None:
      engines = [self.engine_for(k) for k in range(self.target_instances)]
      self.sampler = StreamingSampler(engines, update.params, version=update.version, admission=self.admission,
                                      seed=self.config.seed, tools=make_tools(self.config.sampler.env, self.tokenizer),
                                      clock=self.phase_clock)
      self.mesh_of = {i: i for i in range(len(engines))}
      if self.bridge is not None:
        self.bridge.version = update.version
    elif update.version > self.sampler.version:
      self.sampler.update_params(update.params, update.version, recompute=self.config.sampler.in_flight_cache == "recompute")

  def _apply_elastic(self) -> None:
    """Adds or retires engine instances (between decode steps) until the target count takes requests; a retired
    instance finishes its in-flight requests first and its queued ones move to the others."""
    sampler = self.sampler
    while len(sampler.instance_ids) < self.target_instances and self.spare_meshes:
      mesh_index = self.spare_meshes.pop()
      self.mesh_of[sampler.add_instance(self.engine_for(mesh_index))] = mesh_index
    while len(sampler.instance_ids) > max(1, self.target_instances):
      last = sampler.instance_ids[-1]
      sampler.retire_instance(last)
      self.spare_meshes.append(self.mesh_of.pop(last))

  def _start(self, lease: Lease, wait_s: float, samples) -> _LeaseRun:
    """Submits a lease's requests (group_size per prompt; samples begun elsewhere resume after their tokens,
    finished ones are scored as they are) and returns what tracks it until it is reported."""
    collector = GroupCollector(self.config.group_size, self.config.sampler.engine.max_prompt_length + self.config.max_new_tokens)
    rows = [Row.from_json(r) for r in lease.rows] if lease.rows else [Row()] * len(lease.prompts)
    for group_id, prompt, row in zip(lease.group_ids, lease.prompts, rows):
      collector.expect(group_id, prompt, lease.step, row)
    self.target_instances = lease.instances
    self._apply_elastic()
    run = _LeaseRun(lease, collector, wait_s, time.perf_counter(), time.time(),
                    np.zeros(len(lease.prompts)), len(lease.prompts) * self.config.group_size)
    if len(lease.prompt_ids) != len(lease.prompts):
      raise ValueError(f"lease {lease.lease_id} carries {len(lease.prompt_ids)} prompts' token ids for "
                       f"{len(lease.prompts)} prompts: a controller of another streamrl_jax version?")
    if self.config.sampler.env.agent:
      self._start_episodes(lease, rows)
    else:
      self._submit(lease, lease.prompt_ids)
    for rollout in (p for p in lease.partials if p.finished):
      i = run.index_of[rollout.group_id]
      self._collect(run, Sample.of_rollout(rollout, lease.prompt_ids[i], self.tokenizer.stop_ids), samples)
    return run

  def _collect(self, run: _LeaseRun, sample: Sample, samples, text: str | None = None, failure: str = "") -> None:
    """A finished sample into its lease's collector, and to the scorer (`text`: what the reward functions score,
    default its completion's text). An agent episode that failed (`failure`: why) is scored 0 and counted."""
    run.lengths[run.index_of[sample.group_id]] += sample.num_tokens / self.config.group_size
    group = run.collector.add(sample)
    where = (f"{group.row.where or 'prompt ' + repr(group.prompt[:40])}, step {run.lease.step}, group "
             f"{sample.group_id}, sample {sample.sample_index}")
    key = (run.lease.lease_id, sample.group_id, sample.sample_index)
    if failure:
      self._agent_failed(key, failure, where)
      return
    with self.phase_clock.phase("reward"):
      text = self.tokenizer.decode(sample.completion_tokens) if text is None else text
      self.scorer.submit(key, question(self.task, group.prompt), text, group.row.fields, where)

  def _agent_failed(self, key: tuple, failure: str, where: str) -> None:
    message = f"agent {self.config.sampler.env.agent!r} {failure} on {where}"
    if self.config.sampler.env.agent_on_error == "stop":
      raise RewardError(f"{message} (EnvConfig.agent_on_error='stop'; 'zero' scores such episodes 0 and counts "
                        "them in reward_errors)")
    failed = self.agents.counters["agent_failures"] + self.agents.counters["agent_timeouts"]
    if failed <= AGENT_FAILURES_SHOWN:
      _log.warning(f"{self.name}: {message}; scored 0, counted in reward_errors"
                   + (" (later failures are only counted)" if failed == AGENT_FAILURES_SHOWN else ""))
    self._agent_scores.append((key, failure_score(failure, len(self.scorer.names))))

  def _start_episodes(self, lease: Lease, rows: list) -> None:
    """Starts `group_size` episodes of the agent program per leased prompt."""
    if self.agents is None:
      self.agents = AgentRollouts(self.config.sampler.env, self.server, self.config.max_new_tokens)
    for group_id, prompt, row in zip(lease.group_ids, lease.prompts, rows):
      self.agents.start((lease.lease_id, group_id), {"prompt": question(self.task, prompt), **row.fields},
                        self.config.group_size)

  def _collect_episodes(self, runs: dict, samples) -> None:
    """Each finished agent episode, as a sample of its group."""
    for result in self.agents.finished():
      lease_id, group_id = result.key
      run = runs.get(lease_id)
      if run is None:
        continue  # its lease was dropped
      prompt_ids = run.lease.prompt_ids[run.index_of[group_id]]
      sample = episode_sample(result, group_id, prompt_ids, self.tokenizer.stop_ids[0], self.sampler.version)
      text, env_reward, failure = scored_text(result)
      self._collect(run, dataclasses.replace(sample, env_reward=env_reward), samples, text=text, failure=failure)

  def _send_scored(self, runs: dict, samples) -> None:
    """Each scored sample to its collector; a group whole and scored goes out. With nothing to decode, waits a
    moment for a reward first (rather than spin)."""
    with self.phase_clock.phase("reward"):
      if self.scorer.pending and (self.sampler is None or not self.sampler.has_work()):
        self.scorer.wait(SCORE_WAIT_S)
      failed, self._agent_scores = self._agent_scores, []
      scored = self.scorer.done() + failed
    for (lease_id, group_id, index), score in scored:
      run = runs[lease_id]
      shard = run.collector.scored(group_id, index, score)
      if shard is not None:
        with self.phase_clock.phase("send"):
          samples.put(shard)
        run.left -= self.config.group_size

  def _decode(self, runs: dict, samples, weights) -> None:
    """One driver step: newer weights first (async: between decode calls), then each finished sample to its
    lease's collector, and each complete group out."""
    sampler = self.sampler
    self._apply_elastic()
    if self.spec.mid_step_swap:
      with self.phase_clock.phase("weight_receive"):
        latest = weights.latest()
        if latest is not None and latest.version > sampler.version:
          sampler.update_params(latest.params, latest.version, recompute=self.config.sampler.in_flight_cache == "recompute")
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
    if self.agents is not None:
      self._collect_episodes(runs, samples)
    if bridge is not None and not sampler.has_work() and not self.scorer.pending:
      bridge.wait(SERVING_IDLE_S)  # agents or clients thinking: wake at their next request

  def _report(self, control, run: _LeaseRun) -> None:
    """The lease's step report, once its last group is out."""
    lease = run.lease
    reply = control.report(StepReport(
        sampler_id=self.sampler_id, lease_id=lease.lease_id, step=lease.step,
        generation_s=time.perf_counter() - run.begin, lengths=tuple(float(x) for x in run.lengths), wait_s=run.wait_s,
        samples=len(lease.prompts) * self.config.group_size, instances=len(self.sampler.instance_ids),
        busy=((run.begin_epoch, time.time()),), rss_mb=resident_mb(), phase_s=tuple(self.phase_clock.take().values())))
    if reply.rejoin:
      raise RejoinRequired(f"{self.name}: the trainer took lease {lease.lease_id} from sampler {self.sampler_id}")

  def _submit(self, lease: Lease, encoded: list) -> None:
    """Dispatches the lease's requests (group_size per prompt) over the engine instances."""
    config, sampler, group = self.config, self.sampler, self.config.group_size
    predicted = np.asarray(lease.predicted_lengths, float) if lease.predicted_lengths else None
    per_request = np.repeat(predicted if predicted is not None else np.zeros(len(encoded)), group)
    dispatch = dispatch_requests(config.scheduling, per_request.tolist(), lease.length_quantiles, sampler.instance_ids,
                                 config.sampler.engine.num_slots, seed=config.seed * 100_003 + lease.step)
    if config.scheduling.resize_engines and not sampler.has_work():  # idle between leases (not in flight)
      for instance_id, batch in dispatch.slot_limits.items():
        slots = engine_slots(batch, config.sampler.engine.num_slots)
        sampler.replace_engine(instance_id, self.engine_for(self.mesh_of[instance_id], slots))
    sampler.set_slot_limits(dispatch.slot_limits)
    single = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                            stop_token_ids=self.tokenizer.stop_ids, num_samples=1)
    begun = {(p.group_id, p.sample_index): p for p in lease.partials}
    for requests in dispatch.plan.assignment:
      for r in requests:
        i, k = divmod(r, group)
        partial = begun.get((lease.group_ids[i], k))
        if partial is not None and partial.finished:
          continue  # scored as it is (`_start`)
        sampler.submit(encoded[i], single, group_id=lease.group_ids[i], instance=dispatch.instance_of[r],
                       predicted_length=None if predicted is None else float(predicted[i]), first_sample_index=k,
                       progress=partial)


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
    if rollout.tokens and len(rollout.tokens) <= budget:
      out.append(rollout)
      budget -= len(rollout.tokens)
  for run in runs.values():
    for sample in run.collector.held():
      if sample.env_reward:
        continue  # an episode's environment reward is not carried: it is sampled again
      if sample.num_tokens <= budget:
        out.append(sample.rollout())
        budget -= sample.num_tokens
  return tuple(out)
