"""RL iterations of the four run modes, simulated at cluster scale.

A `SimConfig` fixes the model, hardware, device split, workload and policies; `simulate(config)` runs
`iterations` RL steps and returns the timeline and throughput. Dispatch uses the same pure policies as
the real pipeline (`streamrl_jax.scheduling`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.modes import MODES, ModeSpec
from streamrl_jax.scheduling import elastic_decision, ptl_at, random_dispatch, skew_aware_dispatch
from streamrl_jax.scheduling.broadcast import TreeMember, broadcast_seconds, broadcast_tree
from streamrl_jax.sim.dataplane import (SimDataPlaneConfig, gather_seconds, gradient_seconds, publish_links,
                                        received_times, shard_broadcast_seconds)
from streamrl_jax.sim.instance import simulate_instance
from streamrl_jax.sim.profiles import (H800, Hardware, LengthDistribution, ModelSpec, memory_max_batch,
                                       scaled_ptl_curve)

DISPATCH = ("random", "skew_aware", "oracle")
# SimConfig fields that moved into its parts (old name: part.field): `moved_field` names the new place.
MOVED_FIELDS = {
    **{f: f"batch.{f}" for f in ("global_batch", "prompt_len", "micro_batch", "length_drift")},
    **{f: f"sampler.{f}" for f in ("ptl_curve", "max_batch", "ranker_recall", "alpha")},
    "sampler_hardware": "sampler.hardware", "trainer_hardware": "trainer.hardware", "train_mfu": "trainer.mfu",
    "train_flops_per_token_per_param": "trainer.flops_per_token_per_param",
    **{f: f"trainer.{f}" for f in ("optimizer_step_s", "colocated_switch_s")},
    "sync_bandwidth_gbs": "sync.bandwidth_gbs", "sync_latency_s": "sync.latency_s",
    **{f: f"sync.{f}" for f in ("sampler_link_gbs", "sampler_sites", "inter_site_gbs", "broadcast")},
    **{f"weight_{f}": f"sync.{f}" for f in ("fanout", "bytes_per_param", "chunk_mb")},
}


@dataclasses.dataclass(frozen=True)
class SimBatchConfig:
  """The batch of one iteration: its size, its prompts, its micro-batches, how its output lengths drift."""

  global_batch: int = 1024  # samples per RL iteration
  prompt_len: int = 512  # tokens of every prompt
  micro_batch: int = 64  # samples per streamed micro-batch
  length_drift: float = 0.0  # per-iteration relative growth of output lengths

  def __post_init__(self):
    if self.global_batch < 1 or self.micro_batch < 1:
      raise ValueError("global_batch and micro_batch must be >= 1")


@dataclasses.dataclass(frozen=True)
class SimSamplerConfig:
  """The samplers' device and cost model: decode latency by batch, batch limit, the ranker's dispatch."""

  hardware: Hardware = H800  # each sampler device
  ptl_curve: tuple[tuple[int, float], ...] = ()  # measured (batch, seconds) points; default: scaled from 7B/H800
  max_batch: int = 0  # 0: what fits in memory
  ranker_recall: float = 0.85  # skew_aware: recall of the true top-20% longest
  alpha: float = 0.2  # skew_aware: the share of predicted-longest samples that form the long tail


@dataclasses.dataclass(frozen=True)
class SimTrainerConfig:
  """The trainer's device and cost model: FLOPs per token, MFU, the optimizer step, colocated switches."""

  hardware: Hardware = H800  # each trainer device
  flops_per_token_per_param: float = 16.0  # PPO: actor and critic fwd+bwd (12), ref and old fwd (4)
  mfu: float = 0.5  # calibrated: with it the 32B/64-GPU balanced split lands on the paper's 40/24
  optimizer_step_s: float = 2.0  # seconds of one optimizer step, after the last micro-batch
  colocated_switch_s: float = 10.0  # colocated: offload/reload and reshard between stages, per switch


@dataclasses.dataclass(frozen=True)
class SimSyncConfig:
  """How a weight version reaches the samplers: the links, their latency, the sites, the broadcast."""

  bandwidth_gbs: float = 50.0  # the trainer's link for weights (GB/s)
  latency_s: float = 0.05  # per version, before its first byte moves
  sampler_link_gbs: float = 0.0  # each sampler's link (0: as the trainer's)
  sampler_sites: tuple[int, ...] = ()  # samplers per site, the trainer's first (default: one per engine, all there)
  inter_site_gbs: float = 0.0  # the link between sites, shared by the copies crossing it (needed with sites)
  broadcast: str = "tree"  # how versions reach the samplers: "tree" (relays, scheduling.broadcast) or "star"
  fanout: int = 1  # children per node of the broadcast tree on the trainer's site
  bytes_per_param: float = 2.0  # bf16 on the wire
  chunk_mb: float = 32.0  # the pipelined chunk of a version

  def __post_init__(self):
    if self.bandwidth_gbs <= 0 or self.latency_s < 0 or self.sampler_link_gbs < 0:
      raise ValueError("sync bandwidth must be > 0 and latency >= 0")
    if self.broadcast not in ("tree", "star"):
      raise ValueError(f"SimSyncConfig.broadcast must be 'tree' or 'star', got {self.broadcast!r}")
    if len(self.sampler_sites) > 1 and self.inter_site_gbs <= 0:
      raise ValueError(f"SimSyncConfig.sampler_sites={self.sampler_sites} spans sites: give inter_site_gbs > 0")


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """A simulated run: model, lengths, mode, dispatch, device split, and the batch's, samplers', trainer's, weight
  sync's and data plane's parts."""

  model: ModelSpec  # the model's size and shape
  lengths: LengthDistribution  # the output lengths sampled
  mode: str = "stream"  # a run mode of `streamrl_jax.modes`
  dispatch: str = "random"  # random, skew_aware or oracle (the true lengths)
  total_devices: int = 64  # sampler and trainer devices together
  sampler_devices: int = 32  # ignored by colocated, which time-shares all devices
  tensor_parallel: int = 4  # devices per engine instance
  iterations: int = 3  # RL iterations simulated
  staleness: int = 1  # async only
  seed: int = 0  # seed of the lengths and the dispatch
  batch: SimBatchConfig = SimBatchConfig()  # the batch: size, prompt length, micro-batch, length drift
  sampler: SimSamplerConfig = SimSamplerConfig()  # the samplers' device, PTL curve, batch limit, ranker
  trainer: SimTrainerConfig = SimTrainerConfig()  # the trainer's device and cost model
  sync: SimSyncConfig = SimSyncConfig()  # the weight sync: links, latency, sites, broadcast
  data_plane: SimDataPlaneConfig = SimDataPlaneConfig()  # the trainer's hosts and links, central or per process

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown mode {self.mode!r}; known: {list(MODES)}")
    if self.dispatch not in DISPATCH:
      raise ValueError(f"unknown dispatch {self.dispatch!r}; known: {list(DISPATCH)}")
    if not self.spec.shared_mesh and not 0 < self.sampler_devices < self.total_devices:
      raise ValueError(f"sampler_devices={self.sampler_devices} must leave devices for the trainer "
                       f"(total {self.total_devices})")
    if self.iterations < 1 or self.staleness < 0:
      raise ValueError("iterations must be >= 1, staleness >= 0")

  @property
  def spec(self) -> ModeSpec:
    """The mode's meaning as flags (the simulator reads these, never the mode's name)."""
    return ModeSpec.of(self.mode, self.staleness)

  @property
  def generation_devices(self) -> int:
    return self.total_devices if self.spec.shared_mesh else self.sampler_devices

  @property
  def training_devices(self) -> int:
    return self.total_devices if self.spec.shared_mesh else self.total_devices - self.sampler_devices


def moved_field(fields) -> None:
  """Raises, naming the new place, for the first of `fields` (SimConfig keyword names) that moved into a part."""
  for name in fields:
    if name in MOVED_FIELDS:
      part, field = MOVED_FIELDS[name].split(".")
      cls = type(getattr(SimConfig, part)).__name__
      raise ValueError(f"SimConfig.{name} moved: set {cls}.{field} instead (SimConfig.{part} = {cls}(...))")


def noisy_predictions(true_lengths: np.ndarray, recall: float, rng: np.random.Generator) -> np.ndarray:
  """Predicted lengths whose top-20% recall of the true top 20% is about `recall` (lognormal noise
  whose width is found by bisection on this batch)."""
  if recall >= 1.0:
    return true_lengths.astype(float)
  noise = rng.standard_normal(len(true_lengths))
  k = max(1, len(true_lengths) // 5)
  true_top = set(np.argsort(-true_lengths, kind="stable")[:k])
  log_len = np.log(true_lengths + rng.uniform(0, 1e-3, len(true_lengths)))

  def recall_at(sigma):
    predicted = log_len + sigma * noise
    return len(true_top & set(np.argsort(-predicted)[:k])) / k, predicted

  lo, hi = 0.0, 10.0
  for _ in range(30):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if recall_at(mid)[0] >= recall else (lo, mid)
  return np.exp(recall_at(lo)[1])


def generation(config: SimConfig, lengths: np.ndarray, rng: np.random.Generator, devices: int):
  """Finish time of every sample (seconds after generation starts) and the per-instance plan."""
  instances = max(1, devices // config.tensor_parallel)
  sampler, prompt_len = config.sampler, config.batch.prompt_len
  hw, tp = sampler.hardware, config.tensor_parallel
  curve = dict(sampler.ptl_curve) or scaled_ptl_curve(config.model, hw, tp)
  max_batch = sampler.max_batch or memory_max_batch(config.model, hw, tp, prompt_len + float(np.mean(lengths)))
  prefill = 2 * config.model.params_b * 1e9 * prompt_len / (tp * hw.bf16_tflops * 1e12 * 0.5)
  if config.dispatch == "random":
    plan = random_dispatch(len(lengths), instances, max_batch, seed=int(rng.integers(1 << 31)))
  else:
    predicted = lengths if config.dispatch == "oracle" else noisy_predictions(lengths, sampler.ranker_recall, rng)
    plan = skew_aware_dispatch(list(map(float, predicted)), instances, max_batch, curve, alpha=sampler.alpha)
  finish = np.zeros(len(lengths))
  for order, batch in zip(plan.assignment, plan.batch_sizes):
    if order:
      finish[list(order)] = simulate_instance(lengths[list(order)], batch, lambda n: ptl_at(curve, n), prefill)
  return finish, plan


def train_seconds(config: SimConfig, tokens: float, devices: int) -> float:
  trainer = config.trainer
  flops = trainer.flops_per_token_per_param * config.model.params_b * 1e9 * tokens
  return flops / (devices * trainer.hardware.bf16_tflops * 1e12 * trainer.mfu)


def sync_seconds(config: SimConfig) -> float:
  """Seconds until every sampler holds a new version: the broadcast tree (or star) of `scheduling.broadcast`
  over the samplers' sites and the links' speeds; per process, every trainer process's link sends its share."""
  sync = config.sync
  sites = sync.sampler_sites or (max(1, config.generation_devices // config.tensor_parallel),)
  site_of = [str(site) for site, count in enumerate(sites) for _ in range(count)]
  members = [TreeMember(i, site, sync.broadcast == "tree") for i, site in enumerate(site_of)]
  parents = broadcast_tree(members, "0", sync.fanout)
  links = 1 if config.spec.shared_mesh else publish_links(config.data_plane, config.training_devices)
  return sync.latency_s + broadcast_seconds(
      parents, dict(enumerate(site_of)), model_bytes=weight_bytes(config), trainer_bps=links * sync.bandwidth_gbs * 1e9,
      sampler_bps=(sync.sampler_link_gbs or sync.bandwidth_gbs) * 1e9, inter_site_bps=sync.inter_site_gbs * 1e9 or None,
      trainer_site="0", chunk_bytes=sync.chunk_mb * 2**20)


def weight_bytes(config: SimConfig) -> float:
  """One version on the wire."""
  return config.model.params_b * 1e9 * config.sync.bytes_per_param


def streamed_training(config: SimConfig, arrivals: np.ndarray, tokens: np.ndarray, start_after: float,
                      devices: int, stream: bool) -> tuple[float, list[tuple[float, float]]]:
  """Trainer end time and busy intervals; with `stream`, each micro-batch starts once its samples are in
  (dynamic-batch pipelining), else the whole batch starts after the last sample. Disaggregated, `arrivals` are when
  the trainer's door has taken each sample (`sim.dataplane.received_times`), a micro-batch pays its broadcast
  (central) and the iteration ends with the gradient reduction and the version's way to the hosts."""
  plane, door = config.data_plane, not config.spec.shared_mesh
  order = np.argsort(arrivals, kind="stable")
  free, busy = start_after, []
  chunk = config.batch.micro_batch if stream else len(order)
  for i in range(0, len(order), chunk):
    part = order[i:i + chunk]
    begin = max(free, float(arrivals[part].max()))
    broadcast = shard_broadcast_seconds(plane, len(part) * float(tokens[part].max()), 1, devices) if door else 0.0
    free = begin + train_seconds(config, float(tokens[part].sum()), devices) + broadcast
    busy.append((begin, free))
  step = config.trainer.optimizer_step_s
  if door:
    step += (gradient_seconds(plane, config.model.params_b * 1e9, devices)
             + gather_seconds(plane, weight_bytes(config), devices))
  busy.append((free, free + step))
  return free + step, busy


def simulate(config: SimConfig) -> dict:
  """Runs the iterations; returns throughput, per-iteration times and the first iteration's timeline."""
  rng = np.random.default_rng(config.seed)
  gen_free = train_free = 0.0
  ready = {0: 0.0}  # policy version -> time its weights are on the sampler
  gen_times, iteration_ends, timeline = [], [], None
  spec, batch, switch_s = config.spec, config.batch, config.trainer.colocated_switch_s
  door_free = 0.0  # the trainer's door (process 0's, centrally) is busy until then
  for i in range(config.iterations):
    lengths = config.lengths.sample(rng, batch.global_batch, scale=(1 + batch.length_drift) ** i)
    finish, plan = generation(config, lengths, rng, config.generation_devices)
    start = max(gen_free, ready[max(0, i - spec.max_lag)])  # the version gate
    arrivals = start + finish
    gen_end = float(arrivals.max())
    tokens = lengths + batch.prompt_len
    if spec.shared_mesh:  # training waits for the whole batch and the switch of the mesh to training
      end, busy = streamed_training(config, arrivals, tokens, gen_end + switch_s, config.training_devices,
                                    stream=False)
      end += switch_s
      ready[i + 1] = end
    else:
      received = received_times(config.data_plane, arrivals, tokens, config.training_devices, door_free)
      door_free = float(received.max())
      end, busy = streamed_training(config, received, tokens, train_free, config.training_devices,
                                    stream=spec.streamed)
      ready[i + 1] = end + sync_seconds(config)
    gen_free = gen_end
    train_free = end
    gen_times.append(gen_end - start)
    iteration_ends.append(ready[i + 1])
    if timeline is None:
      timeline = _timeline(plan, arrivals, start, busy, ready[1], config)
  total = iteration_ends[-1]
  return {"samples_per_s": batch.global_batch * config.iterations / total, "total_s": total,
          "iteration_s": float(np.mean(np.diff([0.0] + iteration_ends))), "generation_s": float(np.mean(gen_times)),
          "timeline": timeline}


def _timeline(plan, arrivals, start, busy, synced, config: SimConfig) -> dict:
  instances = [(start, float(arrivals[list(order)].max()) if order else start) for order in plan.assignment]
  return {"instances": instances, "long_instances": plan.long_instances, "trainer": busy,
          "sync": (busy[-1][1], synced) if not config.spec.shared_mesh else None}


def simulate_elastic(config: SimConfig, *, hysteresis: float = 0.05) -> dict:
  """Disaggregated iterations while output lengths drift; before each iteration the elastic policy adds
  or removes one sampler instance (of `tensor_parallel` devices) from estimates of T_gen at S - tp, S and
  S + tp and of T_train. Returns the sampler devices and stage times per iteration."""
  rng = np.random.default_rng(config.seed)
  sampler, unit = config.sampler_devices, config.tensor_parallel
  history = []
  batch = config.batch
  for i in range(config.iterations):
    lengths = config.lengths.sample(rng, batch.global_batch, scale=(1 + batch.length_drift) ** i)
    gen = {s: float(generation(config, lengths, np.random.default_rng(i), s)[0].max())
           for s in (sampler - unit, sampler, sampler + unit) if unit <= s <= config.total_devices - unit}
    train = train_seconds(config, float((lengths + batch.prompt_len).sum()), config.total_devices - sampler)
    history.append({"iteration": i, "sampler_devices": sampler, "t_gen": gen[sampler], "t_train": train})
    saved = gen[sampler] - gen.get(sampler + unit, gen[sampler])
    lost = gen.get(sampler - unit, float("inf")) - gen[sampler]
    sampler += unit * elastic_decision(gen[sampler], train, saved, lost, hysteresis=hysteresis)
  return {"sampler_devices_by_iteration": [h["sampler_devices"] for h in history], "iterations": history}
