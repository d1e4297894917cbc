"""A compiled program's per-device figures: XLA's memory analysis (arguments, outputs, temporaries, code), its cost
analysis (FLOPs and bytes, each loop's body counted once), and its collectives' bytes read off the optimized HLO."""

from __future__ import annotations

import dataclasses
import re
import time

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
              "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_OP = re.compile(r"=\s*(\(.*?\)|[\w\[\],{}:()]+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(pred|bf16|f8e\w+|[sufc]\d+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """One compiled program on one device of its mesh."""

  name: str
  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written over donated arguments
  temp_bytes: int
  code_bytes: int
  xla_flops: float  # XLA's count: the body of a loop (the head's vocabulary chunks, a decode scan) counted once
  xla_bytes: float
  collective_bytes: dict  # kind -> bytes of the results of its collectives, each op once
  compile_s: float
  kernels: int = 0  # Pallas kernel calls in the optimized HLO (`tpu_custom_call`; on a CPU, interpret mode has none)
  refused: str = ""  # the compiler's refusal when the program does not fit its device (the figures are then its own:
  # the temporaries it needed)

  @property
  def peak_bytes(self) -> int:
    """What the device holds while the program runs: its arguments, its outputs less those aliasing donated
    arguments, its temporaries and its code."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

  @property
  def collective_total(self) -> int:
    return sum(self.collective_bytes.values())

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "peak_bytes": self.peak_bytes}


_NEEDED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def program_cost(name: str, lowered) -> ProgramCost:
  """Compiles `lowered` (a `jax.stages.Lowered`) and reads its figures. A program TPU's compiler refuses for want of
  memory gives the temporaries it said it needed (and no other figure)."""
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as err:  # noqa: BLE001 - jax's JaxRuntimeError: read what the compiler says of memory, else raise
    needed = _NEEDED.search(str(err))
    if not needed:
      raise
    temp = int(float(needed.group(1)) * _UNITS[needed.group(2)])
    return ProgramCost(name, 0, 0, 0, temp, 0, 0.0, 0.0, {}, time.perf_counter() - start,
                       refused=str(err).strip().splitlines()[0][:300])
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  hlo = compiled.as_text()
  return ProgramCost(name, memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes,
                     memory.temp_size_in_bytes, memory.generated_code_size_in_bytes, float(cost.get("flops", 0.0)),
                     float(cost.get("bytes accessed", 0.0)), collective_bytes(hlo), seconds,
                     hlo.count('custom_call_target="tpu_custom_call"'))


def collective_bytes(hlo: str) -> dict[str, int]:
  """Bytes of the results of each kind of collective in an optimized HLO module's text (an asynchronous one's
  output once, its `-done` not again)."""
  out: dict[str, int] = {}
  for line in hlo.splitlines():
    match = _OP.search(line)
    if not match:
      continue
    shapes = [_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(match.group(1))]
    if match.group(3) and match.group(2) in ("all-gather", "collective-permute") and len(shapes) > 1:
      shapes = shapes[-1:]  # (operand, output, ...): the output alone
    elif match.group(3):
      shapes = [s for s in shapes if s > 8]  # context scalars apart
    out[match.group(2)] = out.get(match.group(2), 0) + sum(shapes)
  return out


def _bytes(dtype: str, dims: str) -> int:
  count = 1
  for d in dims.split(","):
    if d:
      count *= int(d)
  return count * ITEM_BYTES.get(dtype, 1)
