"""The goals of `benchmarks/goals.toml` read and checked, and a benchmark's JSON judged against them.

A goal holds for the work its benchmark's `workload` and `process` name, at full size. A quick run (`--quick`)
judges only the figures marked `quick = true` (invariants that hold at any size: counts that must be 0, parity,
byte ratios); the others it reports with the verdict "full size only", never "met".
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path

GOALS = Path(__file__).resolve().parent / "goals.toml"
GOAL = re.compile(r"^(>=|<=|==|<|>)\s*(\S+)$")
ABOUT = ("issue", "workload", "quick", "process")  # what each benchmark says of the work its goals are about
FIGURE_KEYS = {"goal", "quick", "what"}
OPTIONAL_KEYS = {"backends"}  # where the goal is judged (jax backends: "cpu", "gpu", "tpu"); elsewhere reported
VERDICTS = {True: "met", False: "not met", None: "report"}
FULL_SIZE_ONLY = "full size only"  # a quick run's figure whose goal only the full size defines


@dataclasses.dataclass(frozen=True)
class Figure:
  goal: str  # ">= 1.5", ..., or "report"
  quick: bool  # a quick run judges it too
  what: str  # what the number is
  backends: tuple[str, ...] = ()  # the jax backends whose runs judge the goal (none named: every backend)


@dataclasses.dataclass(frozen=True)
class Benchmark:
  issue: str
  workload: str
  quick: str
  process: str
  figures: dict[str, Figure]

  def about(self) -> dict:
    return {k: getattr(self, k) for k in ABOUT}


def load_goals(path: Path = GOALS) -> dict[str, Benchmark]:
  """{benchmark: Benchmark}; anything missing or malformed is an error naming the benchmark and key."""
  raw = tomllib.loads(path.read_text())
  out = {}
  for bench, table in raw.items():
    where = f"{path}: [{bench}]"
    missing = [k for k in (*ABOUT, "figures") if k not in table]
    if missing:
      raise ValueError(f"{where} lacks {missing[0]!r} (every benchmark states {', '.join(ABOUT)} and its figures)")
    extra = sorted(set(table) - {*ABOUT, "figures"})
    if extra:
      raise ValueError(f"{where} has an unknown key {extra[0]!r}")
    figures = {}
    for name, spec in table["figures"].items():
      if not isinstance(spec, dict) or not FIGURE_KEYS <= set(spec) <= FIGURE_KEYS | OPTIONAL_KEYS:
        raise ValueError(f"{where} {name}: expected {{ goal = ..., quick = true|false, what = ... }} (and optionally "
                         f"backends = [...]), got {spec!r}")
      backends = spec.get("backends", [])
      if not isinstance(backends, list) or not set(backends) <= {"cpu", "gpu", "tpu"}:
        raise ValueError(f"{where} {name}: backends must be a list of 'cpu', 'gpu', 'tpu', got {backends!r}")
      goal = spec["goal"]
      if goal != "report" and not GOAL.match(goal):
        raise ValueError(f"{where} {name} = {goal!r}: expected 'report' or an op (>=, <=, ==, <, >) and a number, "
                         "true or false")
      if not isinstance(spec["quick"], bool):
        raise ValueError(f"{where} {name}: quick must be true or false, got {spec['quick']!r}")
      figures[name] = Figure(goal, spec["quick"], spec["what"], tuple(backends))
    if not figures:
      raise ValueError(f"{where} has no figures")
    out[bench] = Benchmark(**{k: str(table[k]) for k in ABOUT}, figures=figures)
  return out


def figure_value(result: dict, path: str):
  """The value at a dotted path of a benchmark's JSON, or KeyError naming the missing step."""
  value = result
  for part in path.split("."):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(part)
    value = value[part]
  return value


def goal_met(value, goal: str) -> bool | None:
  """Whether `value` meets `goal` (None for "report"); a value that is not a number or boolean does not."""
  if goal == "report":
    return None
  op, want = GOAL.match(goal).groups()
  if want in ("true", "false"):
    return isinstance(value, bool) and (value == (want == "true")) == (op == "==")
  if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
    return False
  want = float(want)
  return {">=": value >= want, "<=": value <= want, "==": value == want, "<": value < want, ">": value > want}[op]


def rows_of(bench: str, result: dict | None, error: str | None, spec: Benchmark | None, quick: bool,
            backend: str = "cpu") -> list[dict]:
  """The rows of one benchmark's run: each figure's value and verdict ("met", "not met", "report", or in a quick run
  "full size only"), or one row saying why there are none. A figure the benchmark names in `quick_omits` (parts too
  long for a quick run) is a row saying so. A figure whose goal names other `backends` than this run's is reported.
  A figure measured over several rounds (its median judged) carries the rounds' [least, most] as `range` (the
  benchmark's `FIGURE_range`)."""
  if result is None:
    return [dict(benchmark=bench, figure="(run)", value=error, goal="", verdict="not met")]
  rows = []
  for name, figure in (spec.figures if spec else {}).items():
    if quick and name in result.get("quick_omits", ()):  # (a full run that omits a figure: "not reported", not met)
      verdict = "report" if figure.goal == "report" else FULL_SIZE_ONLY
      rows.append(dict(benchmark=bench, figure=name, value="full run only", goal=figure.goal, verdict=verdict))
      continue
    try:
      value = figure_value(result, name)
    except KeyError:
      value = "not reported"
    verdict = VERDICTS[goal_met(value, figure.goal)]
    if figure.backends and backend not in figure.backends:
      verdict = "report"
    if quick and not figure.quick and figure.goal != "report" and value != "not reported":
      verdict = FULL_SIZE_ONLY
    row = dict(benchmark=bench, figure=name, value=value, goal=figure.goal, verdict=verdict)
    rows.append(row | ({"range": result[f"{name}_range"]} if f"{name}_range" in result else {}))
  return rows
