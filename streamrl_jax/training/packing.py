"""Packing: samples end to end into rows of a fixed length (segment ids keep them apart), the trainer calls a
packed chunk is cut into, the shapes those calls can take (what a precompile must cover), and the tokens (padding
included) a call may hold within an activation-memory budget. Plain numpy; no trainer."""

from __future__ import annotations

import numpy as np

from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.lora import adapter_param_count
from streamrl_jax.training.host_batch import pad_rows
from streamrl_jax.run_shape import RunShape
from streamrl_jax.training.config import TrainerConfig

TRIM_MULTIPLE = 8  # a packed chunk's last piece is trimmed to a multiple of this many columns ...
TRIM_WIDTHS = 4  # ... and of a quarter of the row: few trimmed shapes (each a compiled program of its own)
# A full call, which carries most of a step's tokens, is trimmed in sixteenths of the row (those above half: at most
# 7 shapes). Samples a little longer than half the row take one row each: SmolLM2's sums (50-79 tokens in rows of
# 96) padded 21-25% of a step's trainer tokens at quarters, 9-12% at 8 columns, and its forward and backward took
# 7.6-8.0 s a step against 8.9-9.3 (colocated, 4 x 8 samples).
FULL_TRIM_WIDTHS = 16
# A trainer call's fixed cost (its gradient buffers and their sum into the state), in tokens of compute: measured
# on SmolLM2 on this CPU, a call of one packed row of 96 takes about twice the time per row of a call of 8.
CALL_COST_TOKENS = 96
REMAT_IGNORED = ("cpu",)  # backends whose compiler keeps a rematerialized layer's activations (measured)


def _piece_plans(units: int, max_units: int) -> list[list[int]]:
  """Ways to send `units` units of rows, each a list of piece sizes in units that covers them: power-of-two pieces
  of `units` rounded up to each multiple of a power of two (no further than `max_units` when that pads), or one
  call of `max_units`."""
  plans = []
  for shift in range(units.bit_length() + 1):
    padded = -(-units // (1 << shift)) << shift
    if padded > units and padded > max_units:
      break
    plans.append([1 << b for b in reversed(range(padded.bit_length())) if padded >> b & 1])
  if 0 < units <= max_units:
    plans.append([max_units])
  return plans


def packed_pieces(chunk: dict, unit: int, max_rows: int = 0) -> list[dict]:
  """A packed chunk cut for the trainer into calls of few shapes: its full rows in power-of-two numbers of `unit`
  rows (the trainer's batch shards) or in one call of `max_rows` (the MicroBatcher's full call), with padding rows
  where a call saved is worth more than the rows added (`CALL_COST_TOKENS`); a last partly filled `unit` of rows
  either joins them or is cut to its longest fill, rounded up to `trim_step(length)` columns, whichever costs
  less. No piece is padded past `max_rows` rows."""
  rows, length = chunk["tokens"].shape
  cost_rows = CALL_COST_TOKENS / length
  tail_rows = rows % unit or unit
  fill = int(np.count_nonzero(chunk["valid"][rows - tail_rows:], axis=1).max())
  step = trim_step(length)
  width = min(length, -(-fill // step) * step)
  options = [(-(-rows // unit), rows, 0)]  # (units of full rows, rows they hold, columns of a trimmed tail)
  if width < length or rows % unit:
    options.append(((rows - tail_rows) // unit, rows - tail_rows, width))
  best = None
  for units, head, trimmed in options:
    for plan in _piece_plans(units, max_rows // unit):
      cost = sum(size * unit + cost_rows for size in plan) + (unit * trimmed / length + cost_rows if trimmed else 0)
      if best is None or cost < best[0] - 1e-9:
        best = (cost, plan, head, trimmed)
  _, plan, head, trimmed = best
  pieces, start = [], 0
  for size in plan:
    piece = {k: v[start:min(start + size * unit, head)] for k, v in chunk.items()}
    missing = size * unit - len(piece["tokens"])
    pieces.append({k: pad_rows(v, missing, 0) for k, v in piece.items()} if missing else piece)
    start += size * unit
  if trimmed:
    pieces.append({k: v[head:, :trimmed] for k, v in chunk.items()})
  return pieces


def trim_step(length: int, widths: int = TRIM_WIDTHS) -> int:
  """The columns a trimmed width is a multiple of: `1 / widths` of the row (a last piece's: a quarter; a full
  call's: `FULL_TRIM_WIDTHS`), rounded up to `TRIM_MULTIPLE`. On XLA:CPU every compiled shape of a 30-layer model
  keeps about 100 MB of code, so trims stay few."""
  return max(TRIM_MULTIPLE, -(-length // (widths * TRIM_MULTIPLE)) * TRIM_MULTIPLE)


def call_rows(unit: int, max_tokens: int, length: int) -> int:
  """The rows of a full packed call: as many whole units of `unit` rows of `length` as `max_tokens` holds (one
  unit at least)."""
  return unit * max(1, max_tokens // length // unit)


def packed_shapes(unit: int, max_tokens: int, length: int) -> list[tuple[int, int]]:
  """Every (rows, columns) shape `packed_pieces` and `trimmed_call` can give for calls of up to `max_tokens` tokens
  in rows of `length`, cut in units of `unit` rows: power-of-two numbers of units up to a full call, the full call
  (`call_rows`) whole and trimmed to more than half the row, and one unit of rows trimmed to each multiple of
  `trim_step(length)` below `length`."""
  full = call_rows(unit, max_tokens, length)
  rows, shapes = unit, []
  while rows < full:
    shapes.append((rows, length))
    rows *= 2
  full_step, step = trim_step(length, FULL_TRIM_WIDTHS), trim_step(length)
  shapes += [(full, length)] + [(full, width) for width in range(full_step, length, full_step) if 2 * width > length]
  return shapes + [(unit, width) for width in range(step, length, step) if (unit, width) not in shapes]


def trimmed_call(chunk: dict) -> dict:
  """A full call's rows cut to their longest fill, rounded up to `trim_step(length, FULL_TRIM_WIDTHS)` columns, when
  that leaves more than half the row (rows whose samples all take more than half a row hold one each, so a call of
  the step's shorter samples is computed without their padding). A full call holds the first row of a first-fit
  packing with more rows after it, which is more than half full: narrower trims cannot happen and are not
  compiled."""
  length = chunk["tokens"].shape[1]
  fill = int(np.count_nonzero(chunk["valid"], axis=1).max())
  step = trim_step(length, FULL_TRIM_WIDTHS)
  width = -(-fill // step) * step
  return {k: v[:, :width] for k, v in chunk.items()} if 2 * width > length and width < length else chunk


def activation_bytes_per_token(model_config: ModelConfig, length: int, trainer=None, platform: str = "cpu",
                               reference: bool = False) -> int:
  """A float32 accumulation's activation memory per token (XLA's temporaries less the gradient buffer), an
  upper bound fitted to `compiled.memory_analysis()` on this CPU (tests/test_logprobs.py checks it):

  - per layer, what the backward pass reads: 8 hidden-sized vectors (residuals, norms, q, attention output, o),
    k and v, 3 MLP-sized ones (gate, up, their product) and 4 attention rows over `length` keys per head (none
    where the fused attention kernel computes it: `TrainerConfig.attention`);
    with `remat` on a GPU, a layer keeps only its input ("layer") or also its matmuls' outputs ("dots") and one
    layer's worth is live again in the backward pass; on a TPU too, where the gradient fence makes each layer's
    weight gradient complete before the layer below's backward (`models.gradient_fence`: without it TPU's compiler
    kept every layer's activations for its delayed weight gradients). XLA:CPU schedules the recomputation next to
    the forward pass, so there remat counts as "none" (an upper bound);
  - the vocabulary: 4 [vocab] rows (logits, log-softmax, their gradients), or 4 [chunk] rows with
    `logprob_chunk` (`training.logprobs`);
  - with `reference` (a KL penalty's frozen policy): one more [vocab] (or [chunk]) row; its forward pass runs
    before the policy's backward, so its layers are not live at the peak.
  `trainer` is a `TrainerConfig` (None: its defaults' full logits, no remat)."""
  c = model_config
  kv = 2 * c.num_kv_heads * c.head_dim
  fused = trainer is not None and (trainer.attention == "splash" or (trainer.attention == "auto" and platform == "tpu"))
  layer = 8 * c.hidden_size + kv + 3 * c.intermediate_size + (0 if fused else 4 * c.num_heads * length)
  remat = "none" if trainer is None or platform in REMAT_IGNORED else trainer.remat
  saved = {"none": layer, "layer": c.hidden_size,
           "dots": 4 * c.hidden_size + kv + 2 * c.intermediate_size}[remat]
  live = c.num_layers * saved + (layer if remat != "none" else 0)
  chunk = c.vocab_size if trainer is None or not trainer.logprob_chunk else min(trainer.logprob_chunk, c.vocab_size)
  vocab = 4 * chunk
  return 4 * (live + vocab + (chunk if reference else 0))


def call_bytes(model_config: ModelConfig, tokens: int, length: int, trainer=None, platform: str = "cpu",
               reference: bool = False) -> int:
  """A trainer call's temporaries for `tokens` tokens in rows of `length`: the float32 gradient it computes before
  adding it to the running sum (with LoRA the adapters' alone), and the activations (`activation_bytes_per_token`)."""
  per_token = activation_bytes_per_token(model_config, length, trainer, platform, reference)
  trained = (adapter_param_count(trainer.lora, model_config) if trainer is not None and trainer.lora.enabled
             else model_config.param_count())
  return 4 * trained + tokens * per_token


# Activations of a call when the device states no memory limit (the CPU). On XLA:CPU a SmolLM2 call of 6 packed rows
# of 96 costs no more per row than one of 9, and one of 16 costs 20% more (the activations leave the caches), so the
# budget stays small: 1 GiB is about 6 such rows.
CPU_ACTIVATION_BYTES = 1 << 30


def auto_budget(model_config: ModelConfig, length: int, trainer=None, platform: str = "cpu",
                reference: bool = False, device_limit: int = 0) -> int:
  """The budget of a call when `TrainerConfig.activation_budget_mb` is 0: 40% of `device_limit` (the mesh's
  devices' memory), or without one (the CPU) the gradient plus `CPU_ACTIVATION_BYTES`, or plus one packed row's
  activations where a row needs more (a larger model always has a call that fits)."""
  if device_limit:
    return int(0.4 * device_limit)
  gradient = call_bytes(model_config, 0, length, trainer, platform, reference)
  one_row = call_bytes(model_config, length, length, trainer, platform, reference)
  return max(gradient + CPU_ACTIVATION_BYTES, one_row)


def chunk_tokens_for(model_config: ModelConfig, length: int, wanted: int, memory_bytes: int, trainer=None,
                     platform: str = "cpu", reference: bool = False) -> int:
  """Tokens per trainer call (padding included): `wanted`, within `memory_bytes` of a call's temporaries
  (`call_bytes`), a whole number of packed rows of `length`. A budget that cannot hold one row is refused, naming the
  smallest that can."""
  gradient = call_bytes(model_config, 0, length, trainer, platform, reference)
  per_token = call_bytes(model_config, 1, length, trainer, platform, reference) - gradient
  fits = max(0, memory_bytes - gradient) // per_token
  if fits < length:
    raise ValueError(f"TrainerConfig.activation_budget_mb={memory_bytes >> 20} holds {fits} tokens after the "
                     f"{gradient >> 20} MiB gradient ({per_token / 2**10:.0f} KiB of activations each), less than one "
                     f"packed row of {length}: the smallest budget that works is "
                     f"{-(-call_bytes(model_config, length, length, trainer, platform, reference) // 2**20)}")
  return min(wanted, fits) // length * length


def pack_plan(valid, length: int, owners=None) -> list[list[tuple[int, int, int]]]:
  """Where each sample goes when packed into rows of `length` tokens, first-fit by decreasing length: one list per
  packed row of (source row, start, count) spans, in their order along the row. `valid` [rows, width] marks each
  sample's tokens (contiguous). Rows that come first hold the longest samples; a sample is never split. With
  `owners` [rows] (the trainer process holding each sample), a packed row holds one owner's samples alone."""
  valid = np.asarray(valid, bool)
  owner = np.zeros(len(valid), np.int64) if owners is None else np.asarray(owners, np.int64)
  spans = []
  for row, mask in enumerate(valid):
    where = np.flatnonzero(mask)
    if where.size == 0:
      continue
    start, count = int(where[0]), int(where.size)
    if where[-1] - start + 1 != count:
      raise ValueError(f"row {row}: its valid tokens are not contiguous; a sample cannot be packed")
    if count > length:
      raise ValueError(f"row {row}: a sample of {count} tokens does not fit packed rows of {length}")
    spans.append((row, start, count))
  spans.sort(key=lambda span: -span[2])
  fill: list[int] = []
  row_owner: list[int] = []
  rows: list[list[tuple[int, int, int]]] = []
  for span in spans:
    who = owner[span[0]]
    target = next((i for i, used in enumerate(fill) if used + span[2] <= length and row_owner[i] == who), len(fill))
    if target == len(fill):
      fill.append(0)
      row_owner.append(who)
      rows.append([])
    rows[target].append(span)
    fill[target] += span[2]
  return rows


def pack_rows(batch: dict, length: int, plan: list | None = None) -> dict:
  """The batch's samples (rows; their valid tokens contiguous) packed end to end into rows of `length` tokens as
  `plan` places them (default: `pack_plan` of all of them). Every per-token field moves with its tokens;
  `segment_ids` numbers the samples of a row 1, 2, ... (0: padding)."""
  plan = pack_plan(batch["valid"], length) if plan is None else plan
  out = {k: np.zeros((len(plan), length) + np.shape(v)[2:], np.asarray(v).dtype) for k, v in batch.items()}
  out["segment_ids"] = np.zeros((len(plan), length), np.int32)
  for target, spans in enumerate(plan):
    offset = 0
    for segment, (row, start, count) in enumerate(spans, 1):
      for key, value in batch.items():
        out[key][target, offset:offset + count] = np.asarray(value)[row, start:start + count]
      out["segment_ids"][target, offset:offset + count] = segment
      offset += count
  return out


def packed_length(config: TrainerConfig, shape: RunShape) -> int:
  """Packed trainer rows' length: `TrainerConfig.pack_length`, or the longest sample rounded up to a multiple of 8."""
  return config.pack_length or -(-shape.longest // 8) * 8
