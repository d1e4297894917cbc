"""Typed messages between the controller, the sampler workers and the trainer worker.

Samples travel as `SampleShard` (Arrow across processes) and weights as `WeightUpdate` (Arrow chunks
across processes); everything else is one of the control records below: the samplers' (`Register` to `Ack`)
and the trainer's (`Published` on, the calls of `pipeline.trainer.control.TrainerControl`), and a follower arm
program's (`ArmJoin` to `ArmState`, answered by `arms.remote`). Their JSON codec, which bounds what a peer sends,
is `message_codec`; refusals quote at most `QUOTE_CHARS` of what was sent (`quote`). Steps travel as 0-based
indices; what people read names them as their metrics rows do (`row_step`).
"""

from __future__ import annotations

import dataclasses
import typing

from streamrl_jax.phase_clock import OTHER, accounted_frac
from streamrl_jax.types import Rollout


def row_step(step: int) -> int:
  """The number of step index `step` (0-based, as leases, shards and plans carry it) in its metrics row (`step`: the
  updates done once it is trained) and in every message."""
  return step + 1


class StepSkipped(Exception):
  """A follower arm does not train this step: it was dropped from its feed, or the follower is too far behind (its
  shard source raises it; the trainer worker goes on to the next step)."""

  def __init__(self, step: int, why: str):
    super().__init__(f"step {row_step(step)} skipped: {why}")
    self.step, self.why = step, why


class BadMessage(ValueError):
  """A control message that is not one of the known records, or whose fields do not fit it."""


class BadShard(ValueError):
  """A sample shard that breaks the run's rules: samples outside the sender's leases, a step mixed with
  another, a group not whole."""


class RejoinRequired(Exception):
  """The trainer does not know this sampler (it was declared lost, or the trainer restarted): drop the
  lease in hand and register again."""


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
  """Parameters of one policy version, placed where the receiver runs them."""

  version: int
  params: typing.Any


@dataclasses.dataclass(frozen=True)
class Register:
  """A sampler joins. `settings` are its configuration bindings, checked against the trainer's; `site` its
  datacenter's label, `relay` the address where it serves the weight versions it holds ("": it does not)."""

  name: str
  settings: dict
  site: str = ""
  relay: str = ""


@dataclasses.dataclass(frozen=True)
class Registered:
  sampler_id: int
  start_step: int
  steps: int
  heartbeat_s: float
  data_endpoints: tuple[str, ...] = ()  # HOST:PORT of each trainer process's sample door, by process (empty: one)


@dataclasses.dataclass(frozen=True)
class LeaseRequest:
  """Asks for work; the controller may hold the request up to `wait_s` while no step is open."""

  sampler_id: int
  wait_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class Lease:
  """Prompts of one step leased to one sampler: generate `group_size` samples of each with weights of
  version >= `min_version`; `instances` is the instance count the controller wants the sampler to run."""

  lease_id: int
  step: int
  group_ids: tuple[int, ...]
  prompts: tuple[str, ...]
  predicted_lengths: tuple[float, ...]  # one per prompt from the ranker, or empty
  length_quantiles: tuple[float, ...]  # percentiles 0..100 of recently realised lengths, or empty
  min_version: int
  instances: int
  partials: tuple[Rollout, ...] = ()  # samples of these groups begun elsewhere (partial rollouts)
  rows: tuple[str, ...] = ()  # one per prompt: its dataset row (`tasks.Row` as JSON) for the rewards; empty: none
  prompt_tokens: tuple[tuple[int, ...], ...] = ()  # one per prompt: its token ids, encoded once by the controller


@dataclasses.dataclass(frozen=True)
class LeaseReply:
  """A lease; or none yet (ask again); or `finished`: the run is over, leave; or `rejoin`: register again."""

  lease: Lease | None
  finished: bool
  rejoin: bool = False


# Where a sampler thread's seconds go (`phase_clock.PhaseClock`): waiting for a lease, waiting for and taking in
# weights, prefill and decode calls (dispatch and the wait for their results), the host's work between calls
# (admission, bookkeeping), reward scoring (detokenizing, handing samples to the scorer, waiting on it), sending
# groups out, reporting leases. A report's `phase_s` gives them in this order, then "other".
SAMPLER_PHASES = ("lease_wait", "weight_receive", "prefill", "decode", "host", "reward", "send", "report")


def _check_phases(phase_s: tuple) -> None:
  if phase_s and len(phase_s) != len(SAMPLER_PHASES) + 1:
    raise ValueError(f"phase_s holds {len(phase_s)} values; it needs {len(SAMPLER_PHASES) + 1} "
                     f"({', '.join(SAMPLER_PHASES)}, other) or none")


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What a sampler measured while generating one lease; sent once the lease's last samples are acknowledged."""

  sampler_id: int
  lease_id: int
  step: int
  generation_s: float
  lengths: tuple[float, ...]  # mean completion tokens per prompt, in lease order
  wait_s: float  # waiting for the lease and its weights
  samples: int
  instances: int
  busy: tuple[tuple[float, float], ...]  # generation intervals, epoch seconds
  rss_mb: float = 0.0  # the sampler process's resident memory
  # the sampler thread's seconds since its previous report, by phase: SAMPLER_PHASES, then "other" (empty: not told)
  phase_s: tuple[float, ...] = ()
  # agent turns whose chat template rendered the episode's sampled text anew (placed after the sampled ids)
  template_prefix_mismatch: int = 0

  def __post_init__(self):
    _check_phases(self.phase_s)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
  sampler_id: int


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
  stop: bool  # the run is over
  rejoin: bool = False  # the controller does not know this sampler: register again


@dataclasses.dataclass(frozen=True)
class VersionQuery:
  """The newest published version, waiting up to `wait_s` for one >= `min_version`; `sampler_id` (when
  given) gets its place in the version's broadcast tree."""

  min_version: int
  wait_s: float = 0.0
  sampler_id: int = -1


@dataclasses.dataclass(frozen=True)
class VersionInfo:
  version: int  # -1: nothing published yet
  source: str = ""  # the relay (HOST:PORT) to fetch it from; "": the trainer


@dataclasses.dataclass(frozen=True)
class Leave:
  """A sampler leaves; leases it has not reported go back to the plan, with the samples it had begun."""

  sampler_id: int
  partials: tuple[Rollout, ...] = ()


@dataclasses.dataclass(frozen=True)
class Ack:
  rejoin: bool = False  # the sender is not (any more) a sampler of this run: register again


@dataclasses.dataclass(frozen=True)
class Delivery:
  """A trainer process's sample door asks process 0's controller whether to take a batch of whole groups of
  `step` from `sampler_id` (the samples stay where they arrived; only this crosses): `lengths` holds each group's
  mean completion tokens."""

  sampler_id: int
  step: int
  group_ids: tuple[int, ...]
  lengths: tuple[float, ...]

  def __post_init__(self):
    if len(self.group_ids) != len(self.lengths):
      raise ValueError(f"{len(self.group_ids)} groups and {len(self.lengths)} lengths")


@dataclasses.dataclass(frozen=True)
class DeliveryStatus:
  """'accept', 'late', 'trained' or 'rejoin' (`Controller.on_shard`), or 'refused' with the reason."""

  status: str
  reason: str = ""


# ---- the trainer's messages to the controller (`pipeline.trainer.control.TrainerControl`) ----------------
@dataclasses.dataclass(frozen=True)
class Published:
  """The trainer has published weights of `version`: steps up to version + max_lag may open."""

  version: int


@dataclasses.dataclass(frozen=True)
class StepTrained:
  """The trainer has trained `step` in `train_s` s; the reply is the step's `StepSummary`."""

  step: int
  train_s: float


@dataclasses.dataclass(frozen=True)
class StepSummaryRequest:
  """The summary of `step`, removing its plan, waiting up to `timeout_s` (None: the controller's own limit)."""

  step: int
  timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class StepSummary:
  """What the samplers measured for one step once all its leases reported; `ranker` holds the ranker's figures
  (`ranker_<name>`; empty without a ranker)."""

  generation_s: float
  sampler_instances: int
  sampler_processes: int
  sampler_rss_mb: float
  ranker: dict
  phase_s: tuple[float, ...] = ()  # the step's reports' `phase_s`, added up over its samplers (empty: none told)
  template_prefix_mismatch: int = 0  # the step's reports', added up

  def __post_init__(self):
    _check_phases(self.phase_s)

  def metrics(self) -> dict:
    """The summary as the step's metrics row has it: `sampler_s/<phase>` seconds (every sampler's added up) and
    `sampler_accounted_frac`, the share of them in a named phase."""
    seconds = {}
    if self.phase_s:
      by_phase = dict(zip((*SAMPLER_PHASES, OTHER), self.phase_s))
      seconds = {**{f"sampler_s/{name}": s for name, s in by_phase.items()},
                 "sampler_accounted_frac": accounted_frac(by_phase)}
    return dict(generation_s=self.generation_s, sampler_instances=self.sampler_instances,
                sampler_processes=self.sampler_processes, sampler_rss_mb=self.sampler_rss_mb,
                template_prefix_mismatch=self.template_prefix_mismatch, **seconds, **self.ranker)


@dataclasses.dataclass(frozen=True)
class Regenerate:
  """The trainer refused the groups `group_ids` of `step` (a token older than the staleness bound): lease them again."""

  step: int
  group_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Backfill:
  """Dynamic sampling: the trainer did not train the groups `filtered` of `step` (equal rewards); the reply
  (`Backfilled`) says how many more prompts of the step are leased."""

  step: int
  filtered: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Backfilled:
  count: int


@dataclasses.dataclass(frozen=True)
class SamplerWaitQuery:
  """How long the samplers waited for leases and weights; the reply is a `SamplerWait`."""


@dataclasses.dataclass(frozen=True)
class SamplerWait:
  seconds: float  # per sampler on average, since the run began


@dataclasses.dataclass(frozen=True)
class ArmJoin:
  """A follower arm's program joins the lead's stream of samples. `run_id`: the run its workdir's checkpoints belong
  to ("" when it has none yet); `settings`: its configuration's stream settings, checked against the lead's."""

  name: str
  run_id: str
  settings: dict


@dataclasses.dataclass(frozen=True)
class ArmJoined:
  """The lead's run, the first step of its stream in this program (earlier steps are not served) and its steps."""

  run_id: str
  start_step: int
  steps: int


@dataclasses.dataclass(frozen=True)
class ArmPoll:
  """A follower program asks after its stream and acknowledges the steps below `checkpointed` as saved (their
  samples are let go)."""

  name: str
  run_id: str
  checkpointed: int


@dataclasses.dataclass(frozen=True)
class ArmState:
  """What the lead knows of a follower's stream: steps it has trained, steps dropped from the follower's feed (it
  was full), and whether the stream is closed (every shard of the run offered)."""

  lead_done: int
  dropped: tuple[int, ...]
  closed: bool


@dataclasses.dataclass(frozen=True)
class ScorerQuery:
  """A trainer asks a scorer program (`streamrl scorer`) what it serves, for the graph's stage `stage`."""

  stage: str


@dataclasses.dataclass(frozen=True)
class ScorerInfo:
  """What a scorer program serves: stage `stage`'s frozen `kind` of model ('teacher' or 'judge'), reading token ids
  below `vocab_size`."""

  stage: str
  kind: str
  vocab_size: int


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
  """Token rows to score: `tokens` and `valid` are [rows, length], row by row."""

  rows: int
  length: int
  tokens: tuple[int, ...]
  valid: tuple[bool, ...]

  def __post_init__(self):
    if len(self.tokens) != self.rows * self.length or len(self.valid) != len(self.tokens):
      raise ValueError(f"{len(self.tokens)} tokens and {len(self.valid)} valid flags for {self.rows} rows of "
                       f"{self.length}")


@dataclasses.dataclass(frozen=True)
class Scores:
  """A scorer's reply: one value a row (a judge's) or one a token, row by row (a teacher's log-probabilities)."""

  values: tuple[float, ...]


QUOTE_CHARS = 80


def quote(value, limit: int = QUOTE_CHARS) -> str:
  """repr(value), cut to `limit` characters: what a refusal may echo of what a peer sent."""
  text = repr(value)
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
