"""The trainer worker's policy: its `Trainer` (with LoRA, the adapters over a frozen base; with a KL penalty, the
frozen reference), the settings of packed micro-batches, the compiles done before the first step, and its flow of the
step graph (a shard's advantages)."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from streamrl_jax.models import ModelConfig, lora
from streamrl_jax.models.peft_io import check_matches, load_adapter
from streamrl_jax.run_shape import RunShape
from streamrl_jax.training import Buckets, MicroBatcher, Scoring, Trainer, TrainerConfig
from streamrl_jax.training.logprobs import Truncation
from streamrl_jax.training.packing import auto_budget, chunk_tokens_for, packed_length
from streamrl_jax.workflow.flow import StageFlow
from streamrl_jax.workflow.pools import Student, trainer_flow


def make_trainer(config: TrainerConfig, shape: RunShape, expert_axis: str, graphdef, params, mesh,
                 resume: bool) -> tuple[Trainer, object]:
  """(the `Trainer` of `config` on `mesh`, the parameters it trains), scoring tokens as `shape` samples them; MoE
  token buckets over `expert_axis`. With a KL penalty, the initial policy stays frozen on the trainer mesh as the
  reference. With LoRA the state holds the adapters alone (loaded from `LoraConfig.init_from` unless `resume`: a
  resume restores them from its checkpoint); the base is frozen on the mesh, and it is the reference."""
  adapters, base = (config.lora if config.lora.enabled else None), None
  if adapters:
    arrays = None
    if adapters.init_from and not resume:
      loaded, arrays = load_adapter(adapters.init_from, nnx.merge(graphdef, params).config)
      check_matches(adapters, loaded)
    graphdef, params, base = lora.adapt(graphdef, params, adapters, arrays)
  reference = params if config.objective.kl_coef > 0 and not adapters else None
  truncation = Truncation(shape.top_k, shape.top_p, shape.min_p)
  trainer = Trainer(graphdef, config.optimizer, config.objective, mesh, config=config,
                    scoring=Scoring(shape.temperature, reference, base, truncation),
                    buckets=Buckets(expert_axis=expert_axis))
  return trainer, params


def merged_policy(trainer: Trainer, params, adapters):
  """The policy's parameters as a plain model's: `params`, or with LoRA (`adapters`: its config) the base with the
  adapters merged."""
  if not adapters:
    return params
  return _merger(trainer.launcher)(trainer.base_params, params, adapters.scale)


@functools.cache
def _merger(launcher):
  """LoRA's merge jitted once per launcher: a jit made anew at each version traced the merge again."""
  return launcher.jit(lora.merge, static_argnums=2)


def precompile(trainer: Trainer, batcher: MicroBatcher, state, chunk_rows: int, width: int):
  """`state` after compiling every micro-batch shape the run's steps can send (`TrainerConfig.precompile`): packed
  calls, or calls of `chunk_rows` samples of up to `width` tokens."""
  if batcher.pack_length:
    return trainer.precompile_packed(state, batcher.chunk_tokens, batcher.pack_length)
  return trainer.precompile(state, chunk_rows, width)


def make_flow(setup, trainer: Trainer, model_config: ModelConfig, params, mesh) -> StageFlow:
  """The trainer's flow of the run's step graph (`setup`: the worker's `TrainerSetup`): its stages on the trainer's
  `mesh`, the run's own pools (`setup.pools`: name -> mesh) and its scorer programs, the reference its trainer's, a
  teacher on its stage's pool, a critic starting from the policy's `params`."""
  shape, config = setup.shape, setup.trainer
  reference = trainer.reference_logprobs if trainer.has_reference else None
  student = Student(model_config.vocab_size, model_config.dtype, shape.longest, setup.tokenizer, (model_config, params),
                    shape.seed)
  pools = {"trainer": mesh, **setup.pools, **setup.workflow.remote_pools()}
  return trainer_flow(setup.workflow, config, shape.advantage, (shape.temperature, Truncation(shape.top_k, shape.top_p,
                      shape.min_p)), pools, student, reference, setup.scorer_tls)


def packing(config: TrainerConfig, shape: RunShape, graphdef, params, mesh, device_bytes: int | None = None) -> dict:
  """MicroBatcher settings for packed rows: the row length, and the tokens (padding included) per call (a whole
  step, a quarter of one in `stream` so training overlaps generation; within the activation memory budget). A
  trainer of several batch shards calls with at least one row per shard, each shard holding its own rows'
  activations. `device_bytes`: each device's memory (default: what this process's first device states; a plan
  gives its chip's)."""
  length = packed_length(config, shape)
  step_tokens = shape.samples_per_step * length
  spec = shape.spec
  wanted = config.chunk_tokens or (step_tokens // 4 if spec.streamed and not spec.max_lag else step_tokens)
  model_config = nnx.merge(graphdef, params).config
  reference, platform = config.objective.kl_coef > 0, mesh.devices.flat[0].platform
  budget = config.activation_budget_mb << 20
  if not budget:
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]  # stats: own devices only
    if device_bytes is None:
      device_bytes = (local[0].memory_stats() or {}).get("bytes_limit", 0)
    limit = int(device_bytes) * mesh.devices.size
    budget = auto_budget(model_config, length, config, platform, reference, limit)
  return dict(pack_length=length, chunk_tokens=chunk_tokens_for(model_config, length, wanted, budget, config,
                                                                platform, reference))
