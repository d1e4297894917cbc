"""A plan's device split and samples/s, from the StreamRL simulator (`sim/`) fed the plan's own profile: the decode
step's roofline at each batch size (its per-token latency curve), the trainer step's FLOPs a token and its optimizer
step, each side at `efficiency` of its roofline, the run's lengths, batch, mode and staleness. Without a split asked
for, every split of whole engine instances that leaves the trainer its tensor-parallel unit is simulated, and the
one of most samples/s is chosen among those the memory estimate lets fit (StreamRL's profile-based allocation: the
simulator's `resource_split` minimises max(T_gen, T_train), which the full run's samples/s measure directly)."""

from __future__ import annotations

from collections.abc import Callable

from streamrl_jax.models import ModelConfig
from streamrl_jax.planning.setup import PlanSetup
from streamrl_jax.planning.chips import Chip
from streamrl_jax.planning.estimates import Profile, why_not
from streamrl_jax.planning.trainer_plan import PRECISION_BYTES
from streamrl_jax.sim.pipeline import (SimBatchConfig, SimConfig, SimSamplerConfig, SimSyncConfig, SimTrainerConfig,
                                       simulate)
from streamrl_jax.sim.profiles import Hardware, LengthDistribution, ModelSpec

LENGTH_SIGMA = 1.0  # the lognormal spread of output lengths the simulator draws (its presets' default)


def hardware(chip: Chip) -> Hardware:
  return Hardware(chip.name, chip.peak_flops / 1e12, chip.hbm_bytes / 1e9, chip.hbm_bytes_per_s / 1e12, 1.0)


def sim_config(setup: PlanSetup, model: ModelConfig, chip: Chip, total: int, sampler: int, profile: Profile,
               new_tokens: float) -> SimConfig:
  """The run as the simulator sees it at `sampler` of `total` chips."""
  engine, tensor = setup.engine, setup.mesh.sampler_tensor_parallel
  spec = ModelSpec(model.architecture, model.param_count() / 1e9, model.num_layers, model.num_kv_heads,
                   model.head_dim)
  lengths = LengthDistribution(median=max(1.0, new_tokens), sigma=LENGTH_SIGMA, max_len=setup.shape.max_new_tokens)
  chip_hw = hardware(chip)
  return SimConfig(
      model=spec, lengths=lengths, mode=setup.shape.mode, total_devices=total, sampler_devices=sampler,
      tensor_parallel=tensor, iterations=3, staleness=setup.shape.staleness, seed=setup.shape.seed,
      dispatch="skew_aware" if setup.scheduling.policy == "skew_aware" else "random",
      batch=SimBatchConfig(global_batch=setup.shape.samples_per_step, prompt_len=engine.max_prompt_length,
                           micro_batch=setup.shape.group_size),
      sampler=SimSamplerConfig(hardware=chip_hw, ptl_curve=profile.decode_curve, max_batch=engine.num_slots),
      trainer=SimTrainerConfig(hardware=chip_hw, flops_per_token_per_param=profile.train_flops_per_token /
                               (model.param_count()), mfu=profile.efficiency, optimizer_step_s=profile.optimizer_s),
      sync=SimSyncConfig(bytes_per_param=PRECISION_BYTES[setup.precision.precision]))


def shardable(model: ModelConfig, trainer: int, tensor: int) -> bool:
  """Whether `trainer` chips of `tensor` on the tensor axis split the weights: the FSDP axis (the rest) must divide the
  hidden size, which the logical rules shard over it (an axis that does not divide is dropped: every weight whole on
  every chip)."""
  return trainer % tensor == 0 and model.hidden_size % (trainer // tensor) == 0


def candidates(setup: PlanSetup, model: ModelConfig, total: int) -> list[int]:
  """Sampler chip counts to try: whole engine instances, leaving the trainer chips that shard its weights."""
  unit, tensor = setup.mesh.sampler_tensor_parallel, setup.mesh.trainer_tensor_parallel
  return [s for s in range(unit, total, unit) if shardable(model, total - s, tensor)]


def choose_split(setup: PlanSetup, model: ModelConfig, chip: Chip, total: int,
                 profile_at: Callable[[int, int], Profile], fits: Callable[[int, int], bool],
                 new_tokens: float) -> tuple[int, float, dict]:
  """(sampler chips, samples/s, every candidate's samples/s) of the best split that fits; `profile_at(sampler,
  trainer)` is the plan's profile at a split, `fits(sampler, trainer)` its memory estimate."""
  scores = {}
  for sampler in candidates(setup, model, total):
    if fits(sampler, total - sampler):
      sim = sim_config(setup, model, chip, total, sampler, profile_at(sampler, total - sampler), new_tokens)
      scores[sampler] = simulate(sim)["samples_per_s"]
  if not scores:
    raise ValueError(f"no split of {total} chips fits both sides in memory (estimated before compiling: "
                     f"{why_not(setup, model, chip, total)}); ask for one with --split to compile it anyway")
  best = max(scores, key=lambda s: (scores[s], -s))
  return best, scores[best], scores


def samples_per_s(setup: PlanSetup, model: ModelConfig, chip: Chip, total: int, sampler: int, profile: Profile,
                  new_tokens: float) -> float:
  """The simulator's samples/s of the run at a given split."""
  return simulate(sim_config(setup, model, chip, total, sampler, profile, new_tokens))["samples_per_s"]
