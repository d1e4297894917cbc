"""The train step on the trainer mesh: micro-batches of any size accumulate, the optimizer runs once per
global batch.

`Trainer.accumulate(state, micro_batch)` adds the gradient of the loss numerator of one micro-batch
(and its denominator) to the state; `Trainer.apply(state)` divides the summed gradient by the summed
denominator, so the update equals that of the whole global batch at once, for every aggregation mode.
Micro-batches are padded to (rows, length) buckets, so compiles stay few.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import launch
from streamrl_jax.models import DEFAULT_RULES, ModelConfig, state_shardings
from streamrl_jax.models.activation_layout import ActivationLayout
from streamrl_jax.models.fused_attention import trainer_kernel
from streamrl_jax.models.moe import ExpertPlacement
from streamrl_jax.training.call_loss import (MAXED, UNDEFINED_WHEN_EMPTY, CallLoss, off_policy_metrics, step_metrics,
                                             zero_sums)
from streamrl_jax.training.config import OptimizerConfig, TrainerConfig
from streamrl_jax.training.host_batch import BATCH_KEYS, CallLayout, bucket, lossless_batch, placed_rows, read_rows
from streamrl_jax.training.logprobs import Truncation
from streamrl_jax.training.low_copy import LowCopy, computed_from
from streamrl_jax.training.objectives import ObjectiveConfig, aggregate
from streamrl_jax.training.packing import packed_shapes
from streamrl_jax.training.trainer_memory import compile_limits, fenced_variables


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  end = cfg.learning_rate * cfg.end_lr_fraction
  decay = {"constant": optax.constant_schedule(cfg.learning_rate),
           "cosine": optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, cfg.end_lr_fraction),
           "linear": optax.linear_schedule(cfg.learning_rate, end, cfg.decay_steps)}[cfg.schedule]
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """AdamW, behind the global-norm clip when `max_grad_norm` is set. The clip itself is the trainer's (`gradient_scale`:
  one factor on each leaf); optax's identity stands in its place, so the state keeps the structure of
  `chain(clip_by_global_norm, adamw)` (checkpoints written before restore)."""
  adamw = optax.adamw(learning_rate_schedule(cfg), cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay)
  return optax.chain(optax.identity(), adamw) if cfg.max_grad_norm else adamw


def gradient_scale(grad_sum, denominator, tokens, max_norm: float) -> tuple[jax.Array, jax.Array]:
  """(the factor of a step's summed gradient, the mean gradient's global norm): 1 / denominator (the mean) times
  optax's global-norm clip (max_norm / norm where the norm reaches max_norm; 0: none), 0 when nothing was
  accumulated. One scalar, so the update multiplies each leaf once, in place: with optax's clip and a norm beside it,
  XLA:CPU kept two gradient-sized temporaries (4.5 GB for a 0.6B model; none this way)."""
  norm = optax.tree.norm(grad_sum) / denominator
  clip = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)) if max_norm else 1.0
  empty = tokens == 0
  return jnp.where(empty, 0.0, clip / denominator), jnp.where(empty, 0.0, norm)


def optimizer_shardings(tx: optax.GradientTransformation, params, mesh: Mesh):
  """The optimizer state's placement: each moment as its parameter (`params` placed on `mesh`), counters replicated
  on the mesh. (Left to XLA, `jit(tx.init)` put the moments on one device, and the state's placement then replicated
  them on every device: 8 bytes a parameter on each, what `streamrl plan` found for an 8B model.)"""
  replicated = NamedSharding(mesh, PartitionSpec())
  return optax.tree_utils.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params),
                                          jax.tree.map(lambda p: p.sharding, params),
                                          transform_non_params=lambda _: replicated)


@flax.struct.dataclass
class TrainState:
  params: nnx.State
  opt_state: optax.OptState
  step: jax.Array  # optimizer steps taken
  rng: jax.Array  # key data; fold_in(rng, step) for per-step randomness
  # float32, like params. An update leaves it and zeroes `sums`: while sums["tokens"] is 0 it holds the last step's,
  # read as zero (zeroing it in the update wrote the whole gradient, after XLA copied it: 0.54 GB for SmolLM2)
  grad_sum: nnx.State
  sums: dict  # loss numerator, denominator, tokens, clipped tokens, kl, entropy of this global batch


def _check(scoring: Scoring, role: str, objective: ObjectiveConfig) -> None:
  """Refuses a trainer that cannot train: a temperature <= 0, an unknown role, a KL penalty with no reference."""
  if scoring.temperature <= 0:
    raise ValueError(f"the trainer's temperature must be > 0 (greedy samples have no log-probability to "
                     f"train on), got {scoring.temperature}")
  if role not in BATCH_KEYS:
    raise ValueError(f"unknown trainer role {role!r}; known: {sorted(BATCH_KEYS)}")
  if role == "policy" and objective.kl_coef > 0 and not objective.kl_in_reward and scoring.ref_params is None \
     and scoring.base_params is None:
    raise ValueError("ObjectiveConfig.kl_coef > 0 needs ref_params (the frozen reference policy)")


@dataclasses.dataclass(frozen=True)
class Scoring:
  """How the policy's tokens are scored. `temperature` is the sampler's: the policy's (and the reference's) logits
  are divided by it before log-probabilities, so tokens are scored under the distribution they were sampled from
  (on-policy, the ratio to the sampler's log-probabilities is then 1 up to float noise, whatever the temperature).
  `ref_params`: the frozen reference policy of a KL penalty. `base_params`: LoRA (`models.lora`): the frozen base,
  placed once and never differentiated or copied; the state's params are then the adapters alone (what `graphdef`
  splits off with `lora.split`), and the reference policy of a KL penalty is the base itself (the adapters zeroed),
  so `ref_params` is not needed."""

  temperature: float = 1.0
  ref_params: object = None
  base_params: object = None
  truncation: Truncation = Truncation()  # the sampler's top-k and top-p: tokens are scored over their support


@dataclasses.dataclass(frozen=True)
class Buckets:
  """How micro-batches and weights are laid out: the logical sharding `rules`, the power-of-two (rows, length)
  buckets micro-batches pad to, from (`min_rows`, `min_length`), and the mesh axis a mixture's experts are split
  over (`MeshConfig.expert_axis`)."""

  rules: object = None
  min_rows: int = 8
  min_length: int = 16
  expert_axis: str = "fsdp"


class Trainer:
  """Owns the trainer mesh's jit boundary: placement, accumulation and the optimizer step."""

  def __init__(self, graphdef, optimizer: OptimizerConfig, objective: ObjectiveConfig, mesh: Mesh, *,
               scoring: Scoring = Scoring(), buckets: Buckets = Buckets(), role: str = "policy",
               config: TrainerConfig = TrainerConfig()):
    """`role="critic"` trains a `ValueModel` with the clipped value loss (`CallLoss.value_loss`: `make_critic`).
    Micro-batches pad to `buckets`; packed ones (with `segment_ids`, see `packing.pack_rows`) keep their length and
    pad rows to a multiple of the mesh's batch shards (`MicroBatcher` sends full calls of one row count and the
    step's rest in few pieces: see `packing.packed_shapes`).
    `config`: log-probabilities over vocabulary chunks and the rematerialisation policy (`TrainerConfig`)."""
    _check(scoring, role, objective)
    self.config, self.role = config, role
    self.graphdef, self.optimizer_config, self.objective, self.mesh = graphdef, optimizer, objective, mesh
    self.rules = {**DEFAULT_RULES, **(buckets.rules or {}), "expert": buckets.expert_axis}
    # a mixture's model config and the placement of its experts join the call's loss at init_state
    layout = ActivationLayout(mesh, trainer_kernel(config.attention, mesh), fenced_variables(scoring.base_params))
    self.loss = CallLoss(objective, config, float(scoring.temperature), role, head_grad=scoring.base_params is None,
                         truncation=scoring.truncation, layout=layout)
    self.tx = make_optimizer(optimizer)
    self.layout = CallLayout(role, mesh, self.rules, buckets.min_rows, buckets.min_length)
    self.min_rows, self.min_length = buckets.min_rows, buckets.min_length
    self.packed_row_quantum = self.layout.packed_row_quantum
    self.launcher = launch.launcher(mesh)  # every program of this trainer goes through it (see launch.py)
    self.ref_params = None if scoring.ref_params is None else launch.copy(self.place(scoring.ref_params))
    self.base_params = None if scoring.base_params is None else self.place(scoring.base_params)  # LoRA's frozen base
    self._adapter_shapes = None  # LoRA: the adapters' shapes (the reference zeroes them), known at init_state
    self._accumulate = self._apply = None  # jitted once the state's shardings are known (init_state)
    self.low_copy = LowCopy()  # the weights in the compute dtype, where a CPU computes in low precision (init_state)
    self._reference = self.launcher.jit(self._reference_impl, out_shardings=NamedSharding(mesh, PartitionSpec()))
    self.compiled_shapes: set[tuple[int, int]] = set()
    self.last_shape = (0, 0)  # the padded shape of the latest micro-batch

  def _build(self, state: TrainState) -> None:
    """Pins the state's shardings as the jitted steps' outputs: every state (fresh, stepped or restored) runs through
    the same executables, so resumes are bit-identical."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    # Accumulation reads the parameters and optimizer state and donates only the sums it adds to: the arrays a
    # checkpoint in flight reads stay whole until the optimizer step (`apply`, which donates the whole state).
    accumulate, apply = compile_limits(state, self.frozen, self._model(state.params, self.frozen).config.compute_dtype)
    self._accumulate = self.launcher.jit(self._accumulate_impl, donate_argnums=(1,), compiler_options=accumulate,
                                         out_shardings=(shardings.grad_sum, shardings.sums))
    self._apply = self.launcher.jit(self._apply_impl, donate_argnums=(0,), compiler_options=apply,
                                    out_shardings=(shardings, NamedSharding(self.mesh, PartitionSpec())))

  def place(self, params):
    return launch.put(params, state_shardings(params, self.mesh, self.rules))

  def _placement(self, model_config: ModelConfig) -> ExpertPlacement | None:
    """The experts split over their mesh axis where it has several devices and divides them (each device computes
    its own experts' rows); None: every expert on every device (the rules replicate them too)."""
    axis = self.rules["expert"]
    size = self.mesh.shape.get(axis, 1)
    return ExpertPlacement(self.mesh, axis) if size > 1 and model_config.num_experts % size == 0 else None

  @property
  def route_shape(self) -> tuple[int, int] | None:
    """(sparse layers, k) of a mixture's routes; None for a dense model (or before init_state)."""
    moe = self.loss.moe
    return None if moe is None else (len(moe.moe_layers), moe.experts_per_token)

  @property
  def frozen(self) -> dict:
    """What every step reads and never changes: the reference policy and LoRA's base (None where absent)."""
    return {"ref": self.ref_params, "base": self.base_params}

  @property
  def has_reference(self) -> bool:
    return self.ref_params is not None or (self.base_params is not None and self.objective.kl_coef > 0)

  def _model(self, params, frozen):
    """The policy of `params` (with LoRA: the adapters over the frozen base)."""
    if frozen["base"] is None:
      return nnx.merge(self.graphdef, params)
    return nnx.merge(self.graphdef, params, frozen["base"])

  def _reference_model(self, frozen):
    """The frozen reference policy: `ref_params`, or LoRA's base (its adapters zeroed: x @ W + 0 exactly)."""
    if frozen["ref"] is not None:
      return nnx.merge(self.graphdef, frozen["ref"])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._adapter_shapes)
    return nnx.merge(self.graphdef, zeros, frozen["base"])

  def _adopt(self, params) -> ModelConfig:
    """What the trainer learns from the parameters it will train (real or shapes): a mixture's config and expert
    placement for the loss, LoRA's adapter shapes, the low-precision copy; returns the model's config."""
    model_config = self._model(params, self.frozen).config
    if model_config.num_experts and self.role == "policy":
      self.loss = dataclasses.replace(self.loss, moe=model_config, placement=self._placement(model_config))
    if self.base_params is not None:
      self._adapter_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    else:
      self.low_copy = LowCopy(model_config.compute_dtype, self.launcher.jit)
    return model_config

  def init_state(self, params, seed: int = 0) -> TrainState:
    # A private copy: placing may hand back the caller's arrays (already on this mesh), which the donated
    # steps would then delete under the caller's model.
    params = launch.copy(self.place(params))
    self._adopt(params)
    with self.launcher.launching():
      grad_sum = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32, device=p.sharding), params)
      opt_state = jax.jit(self.tx.init, out_shardings=optimizer_shardings(self.tx, params, self.mesh))(params)
    replicated = NamedSharding(self.mesh, PartitionSpec())

    def on_mesh(x):  # optimizer counters and scalars: replicated on this mesh, not on device 0
      if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh:
        return x
      if jax.process_count() > 1:  # one array across the processes, each its own copy (a checkpoint reads them)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])
      return launch.put(x, replicated)
    state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                       rng=jax.random.key_data(jax.random.key(seed)), grad_sum=grad_sum,
                       sums=zero_sums(self.loss.moe is not None))
    state = jax.tree.map(on_mesh, state)
    if self._accumulate is None:
      self._build(state)
    return state

  def abstract_state(self, params) -> TrainState:
    """The state `init_state` makes from parameters of these shapes (`jax.ShapeDtypeStruct`s), placed as it would place
    them, no value made: what a plan compiles this trainer's programs against (`planning/`)."""
    params = launch.put(params, state_shardings(params, self.mesh, self.rules))  # shapes in, shapes out
    self._adopt(params)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    opt_state = launch.put(jax.eval_shape(self.tx.init, params), optimizer_shardings(self.tx, params, self.mesh))
    sums = jax.eval_shape(lambda: zero_sums(self.loss.moe is not None))
    state = TrainState(params=params, opt_state=opt_state,
                       step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
                       grad_sum=launch.put(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params),
                                           jax.tree.map(lambda p: p.sharding, params)),
                       sums=launch.put(sums, replicated))
    if self._accumulate is None:
      self._build(state)
    return state

  # ---- host side: validation, padding, placement ----------------------------------------------
  def prepare(self, batch: dict) -> dict:
    """Checks a micro-batch and pads it to its (rows, length) bucket, placed on the mesh (`CallLayout.placed`)."""
    placed, shape = self.layout.placed(batch, self.route_shape)
    self.compiled_shapes.add(shape)
    self.last_shape = shape
    return placed

  def call_shapes(self, rows: int, length: int, packed: bool = True) -> dict:
    """A call of this shape as shapes on the mesh, every column scored (`CallLayout.shapes`)."""
    return self.layout.shapes(rows, length, packed, self.route_shape)

  def lowered_accumulate(self, state: TrainState, call: dict):
    """The accumulation of one call (`call_shapes`, or placed arrays) lowered for the state's mesh, to compile."""
    return self._accumulate.trace(state.params, (state.grad_sum, state.sums), call, self.frozen,
                                  self.low_copy.of(state.params)).lower()

  def lowered_apply(self, state: TrainState):
    """The optimizer step lowered for the state's mesh, to compile."""
    return self._apply.trace(state).lower()

  def precompile(self, state: TrainState, max_rows: int, max_length: int) -> TrainState:
    """Compiles accumulation for every (rows, length) bucket up to `max_rows` x `max_length` by accumulating batches
    that carry no loss (the state's values do not change): no compile stalls the run later."""
    rows_buckets = sorted({bucket(n, self.min_rows) for n in range(1, max_rows + 1)})
    for rows in rows_buckets:
      for length in sorted({bucket(n, self.min_length) for n in range(1, max_length + 1)}):
        state = self.accumulate(state, lossless_batch(BATCH_KEYS[self.role], rows, length, False, self.route_shape))
    return state

  def precompile_packed(self, state: TrainState, max_tokens: int, length: int) -> TrainState:
    """`precompile` for packed micro-batches of rows of `length` up to `max_tokens` tokens: every shape
    `MicroBatcher` can send (`packing.packed_shapes`: full calls whole or trimmed, pieces, a trimmed last unit)."""
    for rows, width in packed_shapes(self.packed_row_quantum, max_tokens, length):
      state = self.accumulate(state, lossless_batch(BATCH_KEYS[self.role], rows, width, True, self.route_shape))
    return state

  def accumulate(self, state: TrainState, batch: dict) -> TrainState:
    """Adds one micro-batch's gradient to the state (no optimizer step)."""
    grad_sum, sums = self._accumulate(state.params, (state.grad_sum, state.sums), self.prepare(batch), self.frozen,
                                      self.low_copy.of(state.params))
    return state.replace(grad_sum=grad_sum, sums=sums)

  def reference_logprobs(self, tokens: np.ndarray, valid: np.ndarray, owners: np.ndarray | None = None) -> np.ndarray:
    """log pi_ref of each token under the frozen reference policy ([rows, length], column 0 is 0): what
    'KL in the reward' needs before advantages are computed. `owners` (a trainer of several processes): each row
    scored on its owner's devices from its tokens there, the scores then on every process."""
    if not self.has_reference:
      raise ValueError("reference_logprobs needs ref_params (the frozen reference policy)")
    return self._scores(None, dict(tokens=tokens, valid=valid), owners)

  def policy_logprobs(self, params, batch: dict) -> np.ndarray:
    """log pi of a micro-batch's tokens [rows, length] under the policy at `params`, not the state's (a step's start:
    `pipeline.trainer.updates`); a mixture's recorded routes replayed as its calls replay them."""
    return self._scores(params, {k: batch[k] for k in ("tokens", "valid", "routes") if k in batch}, None)

  def _scores(self, params, values: dict, owners) -> np.ndarray:
    placed, where = placed_rows(values, owners, self.mesh, (self.min_rows, self.min_length), self.rules)
    return read_rows(self._reference(params, self.frozen, placed), where)[:, :np.shape(values["tokens"])[1]]

  def _reference_impl(self, params, frozen, batch):
    model = self._reference_model(frozen) if params is None else self._model(params, frozen)
    return self.loss.token_logprobs(model, batch, replay=params is not None)[0]

  def apply(self, state: TrainState) -> tuple[TrainState, dict]:
    """One optimizer step with the accumulated gradient; returns the new state and the batch's metrics."""
    self.low_copy.clear()  # its weights are about to be donated
    state, metrics = self._apply(state)
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    return state, {k: v for k, v in values.items() if not (k in UNDEFINED_WHEN_EMPTY and math.isnan(v))}

  # ---- device side --------------------------------------------------------------------------
  def _accumulate_impl(self, params, totals, batch, frozen, low):
    """(grad_sum, sums) with one micro-batch added; `totals` is the state's (grad_sum, sums); `low`: the weights'
    copy in the compute dtype, or None (`low_copy`)."""
    grad_sum, sums = totals
    loss = self.loss
    reference = (self._reference_model(frozen) if frozen["ref"] is not None or (frozen["base"] is not None and
                                                                                 self.objective.kl_coef > 0) else None)

    def loss_fn(params):
      out = loss.per_token(self._model(computed_from(params, low), frozen), reference, batch)
      numerator, denominator = aggregate(out.pop("loss"), out["mask"], self.objective, batch.get("segment_ids"))
      # a term of the call weighs as much as the call's share of the step's loss denominator
      terms = loss.terms(out["trace"], batch) * jax.lax.stop_gradient(denominator)
      return numerator + terms, dict(out, denominator=denominator, terms=terms)

    (numerator, outputs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    add = loss.call_sums(batch, {**outputs, "numerator": numerator})
    fresh = sums["tokens"] == 0  # grad_sum is the last step's (TrainState): this batch starts it again
    grad_sum = jax.tree.map(lambda a, g: jnp.where(fresh, 0.0, a) + g.astype(jnp.float32), grad_sum, grads)
    return grad_sum, {k: jnp.maximum(sums[k], add[k]) if k in MAXED else sums[k] + add[k] for k in sums}

  def _apply_impl(self, state: TrainState):
    denominator = jnp.maximum(state.sums["denominator"], 1e-8)
    scale, grad_norm = gradient_scale(state.grad_sum, denominator, state.sums["tokens"],
                                      self.optimizer_config.max_grad_norm)
    grads = jax.tree.map(lambda g: g * scale, state.grad_sum)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    tokens = jnp.maximum(state.sums["tokens"], 1.0)
    metrics = dict(loss=state.sums["numerator"] / denominator, grad_norm=grad_norm,
                   learning_rate=learning_rate_schedule(self.optimizer_config)(state.step),
                   tokens=state.sums["tokens"], clip_frac=state.sums["clipped"] / tokens,
                   kl=state.sums["kl"] / tokens, entropy=state.sums["entropy"] / tokens,
                   logprob_mismatch_kl=state.sums["mismatch_kl"] / tokens, logprob_mismatch_max=state.sums["mismatch_max"])
    if self.role == "policy":
      metrics.update(off_policy_metrics(state.sums))
    moe = self.loss.moe is not None
    metrics.update(step_metrics(state.sums, denominator, moe))
    new = state.replace(params=params, opt_state=opt_state, step=state.step + 1, sums=zero_sums(moe))
    return new, metrics


def compiled_memory(trainer: Trainer, state: TrainState, rows: int, length: int, packed: bool = True) -> dict:
  """XLA's memory analysis of `trainer` accumulating one micro-batch of this shape: the bytes of its arguments,
  outputs and temporaries (`temp`: activations, the gradient before it is added, the log-probability chunks), and the
  FLOPs XLA counts in it. The call scores every column: the most a call of this shape needs (`Trainer.prepare`)."""
  compiled = trainer.lowered_accumulate(state, trainer.call_shapes(rows, length, packed)).compile()
  analysis, cost = compiled.memory_analysis(), compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return dict(argument=analysis.argument_size_in_bytes, output=analysis.output_size_in_bytes,
              temp=analysis.temp_size_in_bytes, alias=analysis.alias_size_in_bytes, flops=cost.get("flops", 0.0))
