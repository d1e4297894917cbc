"""`streamrl train` end to end on a tiny run: outputs, metrics keys, gin mistakes."""

import json
from pathlib import Path

import pytest

from streamrl_jax import cli

DEMO_GIN = str(Path(__file__).resolve().parent.parent / "configs" / "demo_cpu.gin")
KEYS = ("step", "reward_mean", "accuracy", "samples_per_s", "staleness_mean", "trainer_idle_frac", "sampler_idle_frac",
        "weight_sync_s")


@pytest.mark.slow
def test_train_command_writes_metrics_pictures_and_models(tmp_path, capsys):
  args = ["train", "--config", DEMO_GIN, "--workdir", str(tmp_path),
          "--set", "PipelineConfig.steps=2", "--set", "PipelineConfig.prompts_per_step=4",
          "--set", "PipelineConfig.group_size=2", "--set", "JobConfig.warmup_steps=2", "--set", "JobConfig.eval_prompts=4",
          "--set", "JobConfig.hidden_size=32"]
  assert cli.main(args) == 0
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2] and all(k in lines[0] for k in KEYS)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["counters"]["samples_trained"] == 2 * 4 * 2 and 0 <= summary["accuracy_after"] <= 1
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e.get("ph") == "X" for e in trace["traceEvents"])
  for name in ("timeline.png", "warmup_model/config.json", "final_model/model.safetensors"):
    assert (tmp_path / name).exists()
  assert list((tmp_path / "tensorboard").iterdir())
  # Resume with one more step: only step 3 runs, metrics are appended.
  longer = [a.replace("PipelineConfig.steps=2", "PipelineConfig.steps=3") for a in args]
  assert cli.main(longer + ["--resume"]) == 0
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2, 3]
  assert json.loads((tmp_path / "summary.json").read_text())["counters"]["samples_trained"] == 4 * 2


def test_train_rejects_gin_mistakes(tmp_path, capsys):
  assert cli.main(["train", "--workdir", str(tmp_path), "--set", "PipelineConfig.mode='pipelined'"]) == 2
  assert "pipelined" in capsys.readouterr().err
  assert cli.main(["train", "--workdir", str(tmp_path), "--set", "PipelineConfig.stepz=3"]) == 2
  assert "stepz" in capsys.readouterr().err
