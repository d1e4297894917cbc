"""Every gin file the project ships (configs/, configs/arms/, examples/) runs here, as its launch line says, on its
own model (the demo decoder, or SmolLM2-135M-Instruct from the package registry), at sizes cut to a step or two:
it must finish, write finite metrics and move the parameters it trains. A shipped file that no run here covers fails
`test_every_shipped_config_has_a_run`."""

import concurrent.futures
import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.processes import finish, train

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_FOLDERS = ("configs", "examples")


@dataclasses.dataclass(frozen=True)
class ShippedRun:
  """One `streamrl train` of shipped files at reduced sizes. `arms`: arm files trained beside the lead."""

  config: str
  mode: str  # the mode the file is meant for (what it sets): checked in the run's config.gin
  sets: tuple[str, ...]
  steps: int
  smollm2: bool = False
  arms: tuple[str, ...] = ()
  demo_warmup: bool = False  # starts from the demo run's warm-up model (the same task and model: not done again)
  gsm8k: bool = False  # reads openai/gsm8k from a Hub cache of GSM8K-shaped files, offline (CI has no Hub)

  @property
  def files(self) -> tuple[str, ...]:
    return (self.config, *self.arms)


# the demo's warm-up cut to 60 steps (of 300): its model already earns rewards that differ within a group, so every run
# from it has a gradient (the agent example's is not cut: at 60 steps every episode fails)
DEMO = ("PipelineConfig.prompts_per_step=8", "PipelineConfig.group_size=4", "JobConfig.eval_prompts=8",
        "JobConfig.warmup_steps=60")
SMOLLM2 = ("PipelineConfig.prompts_per_step=4", "PipelineConfig.group_size=4", "PipelineConfig.max_new_tokens=12",
           "JobConfig.eval_prompts=4", "EngineConfig.num_slots=8")
RUNS = {
    "demo": ShippedRun("configs/demo_cpu.gin", "async", DEMO, 2),
    "stream": ShippedRun("configs/stream_cpu.gin", "stream", DEMO, 2, demo_warmup=True),
    "skew": ShippedRun("configs/skew_cpu.gin", "async", DEMO + ("PipelineConfig.prompts_per_step=10",), 2,
                       demo_warmup=True),
    "arms": ShippedRun("configs/demo_cpu.gin", "async", DEMO, 2, demo_warmup=True,
                       arms=("configs/arms/dr_grpo.gin", "configs/arms/rloo.gin")),
    "smollm2": ShippedRun("configs/smollm2_cpu.gin", "async", SMOLLM2, 1, smollm2=True),
    "smollm2_lora": ShippedRun("configs/smollm2_lora_cpu.gin", "async", SMOLLM2, 1, smollm2=True),
    "own_task": ShippedRun("examples/own_task/own_task.gin", "async",  # its 48 new tokens: shorter ones reach no number
                           ("PipelineConfig.prompts_per_step=8", "PipelineConfig.group_size=4", "JobConfig.eval_prompts=2",
                            "EngineConfig.num_slots=32"), 1, smollm2=True),
    "gsm8k": ShippedRun("examples/gsm8k/gsm8k.gin", "async", SMOLLM2 + ("PipelineConfig.max_new_tokens=24",), 1,
                        smollm2=True, gsm8k=True),
    "own_algorithm": ShippedRun("examples/own_algorithm/own_algorithm.gin", "async", DEMO, 2, demo_warmup=True),
    "agent": ShippedRun("examples/agent/agent.gin", "stream", ("PipelineConfig.prompts_per_step=4",
                                                                "JobConfig.eval_prompts=8"), 2),
}


def test_every_shipped_config_has_a_run():
  shipped = {str(p.relative_to(ROOT)) for folder in SHIPPED_FOLDERS for p in (ROOT / folder).rglob("*.gin")}
  covered = {f for run in RUNS.values() for f in run.files}
  assert shipped == covered, f"shipped but run nowhere here: {sorted(shipped - covered)}; gone: {sorted(covered - shipped)}"


def _weights(directory: Path) -> dict:
  return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _moved(before: Path, after: Path) -> list[str]:
  """Names of the tensors that differ between two saved models (both finite, of one set of names)."""
  old, new = _weights(before), _weights(after)
  assert sorted(old) == sorted(new)
  assert all(np.isfinite(v).all() for v in new.values()), f"{after}: a non-finite parameter"
  return [k for k in old if not np.array_equal(old[k], new[k])]


def _rows(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def gsm8k_cache(cache: Path) -> dict:
  """A Hub cache holding openai/gsm8k's two Parquet files (GSM8K's layout and columns, problems made here); the
  environment that reads it offline."""
  from tests.checkpoints import hub_layout, write_parquet

  rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?",
           "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
          for a in range(2, 12) for b in range(3, 7)]
  files = cache.parent / "gsm8k_files"
  write_parquet(files / "main" / "train-00000-of-00001.parquet", rows[8:])
  write_parquet(files / "main" / "test-00000-of-00001.parquet", rows[:8])
  hub_layout(cache, "openai/gsm8k", {"e" * 40: files}, {"main": "e" * 40}, kind="dataset")
  return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _train(run: ShippedRun, workdir: Path) -> str:
  """The run's `streamrl train` to its end; its output."""
  sets = [a for s in (*run.sets, f"PipelineConfig.steps={run.steps}") for a in ("--set", s)]
  arms = ["--arms", *run.arms] if run.arms else []
  env = gsm8k_cache(workdir.parent / "hub") if run.gsm8k else None
  code, out = finish(train(workdir, "--config", str(ROOT / run.config), *sets, *arms, env=env, cwd=ROOT), workdir,
                     timeout=900)
  assert code == 0, f"{run.config}: streamrl train exited {code}\n{out[-3000:]}"
  return out


# Longest first; the runs that start from the demo's warm-up model after the demo run.
ORDER = ("demo", "smollm2", "own_task", "gsm8k", "agent", "smollm2_lora", "arms", "skew", "stream", "own_algorithm")
CONCURRENT = 2  # runs at once: each keeps about 1.5 of this machine's 2 cores busy, and SmolLM2's two fit in memory


@pytest.fixture(scope="module")
def shipped_runs(request, tmp_path_factory):
  """{name: future of (workdir, output)} for the runs this session selected, two at a time (on 2 cores a run
  leaves about half a core idle: two side by side take about 3/4 of their time one after the other)."""
  wanted = {item.callspec.params["name"] for item in request.session.items
            if item.originalname == "test_a_shipped_config_runs_and_learns"}
  if any(RUNS[name].smollm2 for name in wanted):
    request.getfixturevalue("smollm2")  # fetched once, before any run reads it
  root, futures = tmp_path_factory.mktemp("shipped"), {}

  def run_one(name: str) -> tuple[Path, str]:
    run, workdir = RUNS[name], root / name
    if run.demo_warmup:
      shutil.copytree(futures["demo"].result()[0] / "warmup_model", workdir / "warmup_model")
    return workdir, _train(run, workdir)

  pool = concurrent.futures.ThreadPoolExecutor(CONCURRENT)
  for name in ORDER:  # the demo run is submitted before any run that waits on it
    if name in wanted or (name == "demo" and any(RUNS[w].demo_warmup for w in wanted)):
      futures[name] = pool.submit(run_one, name)
  try:
    yield futures
  finally:
    pool.shutdown(wait=True, cancel_futures=True)  # each run is killed by `finish` on its own failure or timeout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_shipped_config_runs_and_learns(name, shipped_runs, request):
  run = RUNS[name]
  workdir, out = shipped_runs[name].result(timeout=1800)
  assert not run.demo_warmup or "loaded the warm-up model" in out
  assert f"PipelineConfig.mode = '{run.mode}'" in (workdir / "config.gin").read_text()
  initial = request.getfixturevalue("smollm2") if run.smollm2 else workdir / "warmup_model"
  outputs = [workdir] + [workdir / "arms" / Path(arm).stem for arm in run.arms]
  for output in outputs:
    rows = _rows(output)
    assert [r["step"] for r in rows] == list(range(1, run.steps + 1)), output
    bad = [(r["step"], k, v) for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not math.isfinite(v)]
    assert not bad, f"{output}: non-finite metrics (step, key, value): {bad}"
    assert any(r.get("grad_norm", 0) > 0 for r in rows), f"{output}: no step had a gradient"
    assert _moved(initial, output / "final_model"), f"{output}: training moved no parameter"
    after = [json.loads(line)["reward"] >= 1.0 for line in (output / "eval_after.jsonl").read_text().splitlines()]
    assert json.loads((output / "summary.json").read_text())["accuracy_after"] == pytest.approx(np.mean(after))
  if name == "own_algorithm":  # the user's stages ran on the trainer: their fields are in every row
    assert all({"stage/shaped", "stage/advantages"} <= set(r) for r in _rows(workdir))
  if name == "smollm2_lora":  # the adapter alone too, and only the adapted projections moved
    assert (workdir / "final_adapter" / "adapter_config.json").exists()
    moved = _moved(initial, workdir / "final_model")
    assert all(any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
               for k in moved), moved


@pytest.mark.slow
def test_the_agent_example_whose_episodes_all_fail_skips_its_steps_and_says_so(tmp_path):
  """The agent example with 8 new tokens a turn: every episode fails, so no sample holds a token to train. Each step
  is skipped with a warning line and `empty_step` in its row, never a crash (it once ended with numpy's 'zero-size
  array to reduction operation maximum which has no identity')."""
  workdir = tmp_path / "run"
  sets = ("PipelineConfig.max_new_tokens=8", "PipelineConfig.steps=2", "PipelineConfig.prompts_per_step=4",
          "JobConfig.warmup_steps=10", "JobConfig.eval_prompts=4")
  code, out = finish(train(workdir, "--config", str(ROOT / "examples/agent/agent.gin"),
                           *[a for s in sets for a in ("--set", s)], cwd=ROOT), workdir, timeout=600)
  assert code == 0, out[-3000:]
  assert out.count("samples hold no token to train") == 2, out[-3000:]
  rows = _rows(workdir)
  assert [(r["step"], r["empty_step"], r["update_skipped"]) for r in rows] == [(1, 1.0, 1.0), (2, 1.0, 1.0)]
  assert json.loads((workdir / "summary.json").read_text())["counters"]["empty_steps"] == 2
  assert not _moved(workdir / "warmup_model", workdir / "final_model")  # the weights stayed as they were
