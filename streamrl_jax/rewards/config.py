"""`RewardConfig`: which functions score a sample, how they are weighted, and where and how long they run."""

from __future__ import annotations

import dataclasses

ON_ERROR = ("stop", "zero")
BUILTIN = "task"  # the name of the task's own verifier, used when no function is configured


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Which functions score a sample, how they are weighted, and how their calls run.

  The total reward is the weighted sum of the functions' numbers."""

  # 'package.module:function' or 'path/to/file.py:function': fn(prompt, completion, **fields) -> number, the
  # fields being the row's other columns; empty: the task's own verifier (in the sampler's thread)
  functions: tuple[str, ...] = ()
  weights: tuple[float, ...] = ()  # one per function; empty: 1 each
  workers: int = 1  # processes that score; 0: in the sampler's own thread (no timeout can stop a hung call)
  timeout_s: float = 30.0  # seconds per call; a worker past it is replaced and the call counted in reward_timeouts
  on_error: str = "stop"  # a call that raises, hangs or returns no finite number: "stop" the run, or score it "zero"

  def __post_init__(self):
    functions = (self.functions,) if isinstance(self.functions, str) else tuple(self.functions)
    weights = (self.weights,) if isinstance(self.weights, (int, float)) else tuple(self.weights)
    object.__setattr__(self, "functions", functions)
    object.__setattr__(self, "weights", tuple(float(w) for w in weights))
    for spec in functions:
      where, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
      if not where or not name.isidentifier():
        raise ValueError(f"RewardConfig.functions: {spec!r} is not 'package.module:function' or "
                         "'path/to/file.py:function'")
    if weights and len(weights) != len(functions):
      raise ValueError(f"RewardConfig.weights has {len(weights)} entries for {len(functions)} functions; give one "
                       "per function (or none: 1 each)")
    if self.workers < 0:
      raise ValueError(f"RewardConfig.workers must be >= 0 (0: in the sampler's thread), got {self.workers}")
    if not self.timeout_s > 0:
      raise ValueError(f"RewardConfig.timeout_s must be > 0, got {self.timeout_s}")
    if self.on_error not in ON_ERROR:
      raise ValueError(f"RewardConfig.on_error={self.on_error!r}; known: {list(ON_ERROR)}")

  @property
  def names(self) -> tuple[str, ...]:
    """The metric name of each function (`reward/<name>`): its own name, with its module where two share one."""
    if not self.functions:
      return (BUILTIN,)
    short = [spec.rpartition(":")[2] for spec in self.functions]
    return tuple(s if short.count(s) == 1 else _qualified(spec) for s, spec in zip(short, self.functions))

  @property
  def function_weights(self) -> tuple[float, ...]:
    return self.weights or (1.0,) * max(1, len(self.functions))


def _qualified(spec: str) -> str:
  where, _, name = spec.rpartition(":")
  stem = where.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py").rsplit(".", 1)[-1]
  return f"{stem}.{name}"
