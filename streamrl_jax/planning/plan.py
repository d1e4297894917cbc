"""A run planned for a topology (`make_plan`): the split of its chips between the sampler and the trainer (asked for,
or the simulator's best that fits), both sides compiled for their chips (`trainer_plan`, `sampler_plan`), the
trainer's attention with and without its kernel, whether each side's peak fits the chip, what would fit when one
does not, and the simulator's samples/s."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from streamrl_jax.models import ModelConfig
from streamrl_jax.models.device_memory import HEADROOM, planned_memory
from streamrl_jax.models.compile_target import compiling_for
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.planning.attention_plan import attention_temporaries
from streamrl_jax.planning.chips import GIB, Chip, Topology, parse_topology
from streamrl_jax.planning.estimates import fits_estimate, profile_at
from streamrl_jax.planning.sampler_plan import plan_sampler
from streamrl_jax.planning.sides import SidePlan
from streamrl_jax.planning.split import choose_split, samples_per_s, shardable
from streamrl_jax.planning.trainer_plan import plan_trainer


@dataclasses.dataclass(frozen=True)
class PlanRequest:
  """What `streamrl plan` is asked beside the run's config."""

  model: str  # a config.json, a model directory, a catalog name, a .gguf file or a Hub id
  topology: str  # 'v5p:4x4x2', 'v6e:8x8', 'cpu:8', ...
  sampler_chips: int = 0  # chips of the sampler side; 0: the simulator's choice (disaggregated modes)
  new_tokens: float = 0.0  # a completion's median length the plan assumes; 0: half of PipelineConfig.max_new_tokens
  efficiency: float = 0.5  # the share of its roofline each side reaches, for the simulator's samples/s

  def __post_init__(self):
    if self.sampler_chips < 0 or self.new_tokens < 0 or not 0 < self.efficiency <= 1:
      raise ValueError(f"plan: --split must be >= 0, --new-tokens >= 0 and --efficiency in (0, 1]; got "
                       f"{self.sampler_chips}, {self.new_tokens}, {self.efficiency}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """A planned run: its topology and split, both sides, the trainer's attention temporaries, and the verdict."""

  request: PlanRequest
  topology: Topology
  model: ModelConfig
  model_source: str
  split: dict  # {"sampler": chips, "trainer": chips, "instances": engine instances, "chosen_by": ...}
  trainer: SidePlan
  sampler: SidePlan
  attention: dict  # the trainer's attention temporaries a device, with the kernel and with XLA's
  samples_per_s: float
  split_scores: dict  # sampler chips -> the simulator's samples/s, for each split tried
  new_tokens: float

  @property
  def chip(self) -> Chip:
    return self.topology.chip

  @property
  def trainer_hbm_frac(self) -> float:
    return self.trainer.hbm_frac(self.chip)

  @property
  def sampler_hbm_frac(self) -> float:
    return self.sampler.hbm_frac(self.chip)

  @property
  def fits(self) -> bool:
    """Both sides' peaks within `HEADROOM` of the chip's memory, every program compiled (none refused for memory),
    and the run's own checks pass (its activation budget holds a trainer call)."""
    return _trainer_fits(self.trainer, self.chip) and self.sampler_hbm_frac <= HEADROOM and not self.sampler.refused


def make_plan(request: PlanRequest, setup: PlanSetup, model: ModelConfig, model_source: str,
              progress: Callable[[str], None] = lambda line: None) -> Plan:
  """The plan of `setup`'s run of `model` (shapes, computing in the dtype the chip's backend resolves) on the
  request's topology; `progress` hears each stage (a pod's compiles take minutes)."""
  topology = parse_topology(request.topology)
  chip, devices = topology.chip, topology.device_list()
  new_tokens = request.new_tokens or setup.shape.max_new_tokens / 2
  total, colocated = len(devices), setup.shape.spec.shared_mesh
  with compiling_for(chip.platform), planned_memory(chip.hbm_bytes):
    sampler_chips, chosen, scores = _first_split(request, setup, model, chip, total, new_tokens, progress)
    trainer_devices = devices if colocated else devices[sampler_chips:]
    progress(f"plan: compiling the trainer's call and optimizer step on {len(trainer_devices)} {chip.name} ...")
    trainer = plan_trainer(setup, model, trainer_devices, chip, new_tokens)
    while scores and not _trainer_fits(trainer, chip):  # the estimate was short: the next best with more trainer chips
      larger = [s for s in scores if s < sampler_chips]
      if not larger:
        break
      sampler_chips = max(larger, key=lambda s: (scores[s], -s))
      trainer_devices = devices[sampler_chips:]
      progress(f"plan: the trainer needs {trainer.peak_bytes / GIB:.1f} GiB a chip there; compiling it on "
               f"{len(trainer_devices)} {chip.name} (the simulator's next best) ...")
      trainer = plan_trainer(setup, model, trainer_devices, chip, new_tokens)
      chosen = "the simulator's best whose trainer compiled to fit"
    progress(f"plan: compiling the sampler's prefill and decode on {setup.mesh.sampler_tensor_parallel} "
             f"{chip.name} ...")
    sampler = plan_sampler(setup, model, devices[:sampler_chips], chip, new_tokens)
    if colocated:
      trainer, sampler = _shared(trainer, sampler)
    progress("plan: compiling the trainer's attention alone, with and without its kernel ...")
    attention = attention_temporaries(model, trainer.notes, trainer_devices[0])
    # under the chip's backend, as the split's score was (the cache's and compute's dtypes are the chip's)
    throughput = samples_per_s(setup, model, chip, total, sampler_chips,
                               profile_at(setup, model, chip, total - sampler_chips or total, new_tokens,
                                          request.efficiency), new_tokens)
  instances = sampler_chips // setup.mesh.sampler_tensor_parallel
  split = dict(sampler=sampler_chips, trainer=len(trainer_devices), instances=instances, chosen_by=chosen)
  return Plan(request, topology, model, model_source, split, trainer, sampler, attention, throughput,
              {str(k): round(v, 3) for k, v in scores.items()}, new_tokens)


def _first_split(request: PlanRequest, setup: PlanSetup, model: ModelConfig, chip: Chip, total: int,
                 new_tokens: float, progress: Callable[[str], None]) -> tuple[int, str, dict]:
  """(sampler chips, why, the simulator's score of each split tried): colocated, asked for, or the simulator's best
  that the memory estimate lets fit."""
  if setup.shape.spec.shared_mesh:
    if request.sampler_chips:
      raise ValueError("--split: PipelineConfig.mode='colocated' time-shares every chip between the two sides")
    return total, "colocated: both sides on every chip", {}
  if request.sampler_chips:
    _check_split(request.sampler_chips, total, setup.mesh.sampler_tensor_parallel)
    return request.sampler_chips, "asked for (--split)", {}
  progress(f"plan: choosing the split of {total} chips with the simulator ...")
  sampler_chips, _, scores = choose_split(
      setup, model, chip, total, lambda s, t: profile_at(setup, model, chip, t, new_tokens, request.efficiency),
      lambda s, t: fits_estimate(setup, model, chip, t), new_tokens)
  return sampler_chips, "the simulator's best that fits", scores


def _trainer_fits(trainer: SidePlan, chip: Chip) -> bool:
  return trainer.hbm_frac(chip) <= HEADROOM and not trainer.refused and not trainer.notes.get("budget_refused")


def _check_split(sampler: int, total: int, tensor: int) -> None:
  if sampler >= total:
    raise ValueError(f"--split {sampler}: the topology has {total} chips, and the trainer needs some")
  if sampler % tensor:
    raise ValueError(f"--split {sampler}: not whole engine instances of MeshConfig.sampler_tensor_parallel={tensor} "
                     "chips")


def _shared(trainer: SidePlan, sampler: SidePlan) -> tuple[SidePlan, SidePlan]:
  """Colocated: each side's peaks with what the other holds on the same chips beside them."""
  with_sampler = {k: v + sum(sampler.held.values()) for k, v in trainer.peaks.items()}
  with_trainer = {k: v + sum(trainer.held.values()) for k, v in sampler.peaks.items()}
  return (dataclasses.replace(trainer, peaks=with_sampler), dataclasses.replace(sampler, peaks=with_trainer))


def advice(plan: Plan) -> str:
  """One line naming what would fit, for a plan that does not."""
  chip, out = plan.chip, []
  refused = plan.trainer.notes.get("budget_refused")
  if refused:
    smallest = re.search(r"the smallest budget that works is (\d+)", refused)
    done = (f"a call of one row a chip compiled: {plan.trainer.peak_bytes / GIB:.1f} GiB a chip"
            if plan.trainer_hbm_frac <= HEADROOM else "a call of one row a chip does not fit either")
    out.append(f"the run would stop at start, its activation budget holding no trainer call: set "
               f"TrainerConfig.activation_budget_mb={smallest.group(1) if smallest else '...'} ({done})")
  if plan.trainer_hbm_frac > HEADROOM:
    trainer, held = plan.trainer, plan.trainer.held
    state = held["weights"] + held["optimizer"] + held["gradient"] + held["frozen"]
    room = HEADROOM * chip.hbm_bytes - (trainer.peak_bytes - state)
    needed = math.ceil(plan.split["trainer"] * state / room) if room > 0 else 0
    tensor = trainer.mesh.get("tensor", 1)
    while needed and not shardable(plan.model, needed, tensor):  # a count whose FSDP axis splits the weights
      needed += 1
    options = []
    if not shardable(plan.model, plan.split["trainer"], tensor):
      options.append(f"trainer chips whose FSDP axis divides the hidden size {plan.model.hidden_size} (the "
                     f"{plan.split['trainer']} asked for shard no weight)")
    if needed >= plan.topology.devices:
      options.append(f"{needed} or more trainer chips: a larger topology")
    elif needed:
      options.append(f"{needed} trainer chips (--split {plan.topology.devices - needed})")
    if trainer.mesh.get("tensor", 1) > 1:
      options.append("MeshConfig.trainer_tensor_parallel=1 (every trainer chip on the fsdp axis)")
    if trainer.notes["remat"] == "none":
      options.append("TrainerConfig.remat='layer'")
    if not trainer.notes["lora"]:
      options.append("LoRA (LoraConfig.rank=16)")
    shards = trainer.mesh.get("fsdp", 1) * trainer.mesh.get("data", 1)
    one_row = trainer.notes.get("one_row")
    if one_row and not one_row["refused"] and one_row["peak_bytes"] <= HEADROOM * chip.hbm_bytes:
      options.insert(0, f"a call of one row a chip (TrainerConfig.chunk_tokens={one_row['chunk_tokens']}: compiled, "
                        f"{one_row['peak_bytes'] / GIB:.1f} GiB)")
    elif trainer.notes["call_rows"] > shards:
      options.append(f"a smaller call (TrainerConfig.chunk_tokens={trainer.notes['call_length'] * shards})")
    out.append(f"the trainer needs {trainer.peak_bytes / GIB:.1f} GiB a chip of {chip.hbm_bytes / GIB:.2f}: "
               + ", or ".join(options))
  if plan.sampler_hbm_frac > HEADROOM:
    sampler = plan.sampler
    out.append(f"the sampler needs {sampler.peak_bytes / GIB:.1f} GiB a chip of {chip.hbm_bytes / GIB:.2f}: "
               f"MeshConfig.sampler_tensor_parallel={2 * sampler.mesh.get('tensor', 1)}, or fewer slots "
               f"(EngineConfig.num_slots={max(1, sampler.notes['slots'] // 2)}) or pages (EngineConfig.kv_pages)")
  return "does not fit: " + "; ".join(out)
