"""`streamrl train` end to end on a tiny run: outputs, metrics keys, gin mistakes."""

import json
from pathlib import Path

import numpy as np
import pytest

from streamrl_jax import cli, gin_config
from tests.checkpoints import word_checkpoint
from tests.tensorboard_events import scalar_steps

DEMO_GIN = str(Path(__file__).resolve().parent.parent / "configs" / "demo_cpu.gin")
KEYS = ("step", "reward_mean", "accuracy", "samples_per_s", "staleness_mean", "trainer_idle_frac", "sampler_idle_frac",
        "weight_sync_s")


@pytest.mark.slow
def test_train_command_writes_metrics_pictures_and_models(tmp_path, capsys):
  args = ["train", "--config", DEMO_GIN, "--workdir", str(tmp_path),
          "--set", "PipelineConfig.steps=2", "--set", "PipelineConfig.prompts_per_step=4",
          "--set", "PipelineConfig.group_size=2", "--set", "JobConfig.warmup_steps=2", "--set", "JobConfig.eval_prompts=4",
          "--set", "DemoModelConfig.hidden_size=32", "--set", "JobConfig.eval_k=2", "--set", "JobConfig.eval_every=2"]
  assert cli.main(args + ["--resume=auto"]) == 0  # no checkpoint yet: a fresh start
  assert "--resume=auto: no checkpoint yet, starting afresh" in "".join(capsys.readouterr())
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2] and all(k in lines[0] for k in KEYS)
  gin_config.parse([tmp_path / "config.gin"])  # what the run wrote it ran with builds the same configs
  ran = gin_config.build_run()
  gin_config.parse([DEMO_GIN], [a for a in args[5:] if a != "--set"])
  assert ran == gin_config.build_run()
  gin_config.parse()
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["counters"]["samples_trained"] == 2 * 4 * 2 and 0 <= summary["accuracy_after"] <= 1
  assert "heldout_avg@2" not in lines[0] and {"heldout_accuracy", "heldout_avg@2", "heldout_pass@2"} <= set(lines[1])
  before = [json.loads(line)["reward"] >= 1 for line in (tmp_path / "eval_before_at_k.jsonl").read_text().splitlines()]
  assert len(before) == 4 * 2 and summary["heldout_avg@2_before"] == pytest.approx(np.mean(before))
  assert 0 <= summary["heldout_avg@2"] <= summary["heldout_pass@2"] <= 1
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e.get("ph") == "X" for e in trace["traceEvents"])
  for name in ("timeline.png", "curves.png", "warmup_model/config.json", "final_model/model.safetensors"):
    assert (tmp_path / name).exists()
  assert list((tmp_path / "tensorboard").iterdir())
  # Resume with one more step: only step 3 runs, metrics are appended, and the outputs read as one run.
  longer = [a.replace("PipelineConfig.steps=2", "PipelineConfig.steps=3") for a in args]
  assert cli.main(longer + ["--resume"]) == 0
  err = capsys.readouterr().err
  assert "2/3 [" in err and "0/3 [" not in err and "3/3 [" in err  # the bar starts at the step resumed
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2, 3]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["counters"]["samples_trained"] == 3 * 4 * 2 and summary["counted_segments"] == 2  # both segments'
  assert scalar_steps(tmp_path / "tensorboard")["reward_mean"] == [1, 2, 3]
  segments = json.loads((tmp_path / "run.json").read_text())["segments"]
  assert [(s["first_step"], s["last_step"]) for s in segments] == [(0, 2), (2, 3)]
  assert summary["steps"] == 3 and summary["resumes"] == 1
  assert summary["heldout_avg@2_before"] == pytest.approx(np.mean(before))  # read back, not measured again
  assert summary["rl_seconds"] == pytest.approx(sum(s["seconds"] for s in segments)) and summary["rl_seconds"] > 0
  lanes = {e["args"]["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
           if e["ph"] == "M"}
  assert {"trainer", "resume"} <= lanes


def test_resume_without_a_checkpoint_fails_before_any_work(tmp_path, capsys, monkeypatch):
  from streamrl_jax.job import warmup
  monkeypatch.setattr(warmup, "supervised_warmup", lambda *a, **k: pytest.fail("warmed up before the check"))
  assert cli.main(["train", "--workdir", str(tmp_path), "--resume"]) == 2
  err = capsys.readouterr().err
  assert "no checkpoint" in err and err.count("\n") == 1 and "%|" not in err


def test_a_run_stopped_before_any_checkpoint_does_not_advise_resume(tmp_path, capsys, monkeypatch):
  from streamrl_jax.job import warmup

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(warmup, "supervised_warmup", interrupted)  # Ctrl-C during the warm-up
  assert cli.main(["train", "--workdir", str(tmp_path), "--set", "JobConfig.eval_prompts=2"]) == 130
  err = capsys.readouterr().err
  assert "no step was checkpointed, so there is nothing to resume" in err and "--resume" not in err


def test_train_rejects_gin_mistakes(tmp_path, capsys):
  assert cli.main(["train", "--workdir", str(tmp_path), "--set", "PipelineConfig.mode='pipelined'"]) == 2
  assert "pipelined" in capsys.readouterr().err
  assert cli.main(["train", "--workdir", str(tmp_path), "--set", "PipelineConfig.stepz=3"]) == 2
  assert "stepz" in capsys.readouterr().err


@pytest.mark.slow
def test_train_on_a_prompt_file_with_a_hugging_face_checkpoint(hf_dirs, tmp_path):
  model_dir = word_checkpoint(hf_dirs, tmp_path / "model")
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("\n".join(json.dumps({"question": f"what is {a} plus {b} ?", "answer": f"#### {a + b}"})
                               for a in range(3) for b in range(3)))
  workdir = tmp_path / "run"
  args = ["train", "--workdir", str(workdir), "--set", "TaskConfig.name='file'",
          "--set", f"TaskConfig.prompt_file='{prompts}'", "--set", f"JobConfig.model='{model_dir}'",
          "--set", "JobConfig.eval_prompts=4", "--set", "PipelineConfig.steps=2", "--set", "PipelineConfig.prompts_per_step=2",
          "--set", "PipelineConfig.group_size=2", "--set", "PipelineConfig.max_new_tokens=8",
          "--set", "EngineConfig.num_slots=4", "--set", "EngineConfig.max_prompt_length=16",
          "--set", "EngineConfig.min_prefill_bucket=16"]
  assert cli.main(args) == 0
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["counters"]["samples_trained"] == 2 * 2 * 2 and not (workdir / "warmup_model").exists()
  assert (workdir / "final_model" / "config.json").exists()


def test_file_task_config_errors(tmp_path, capsys):
  assert cli.main(["train", "--workdir", str(tmp_path), "--set", "TaskConfig.name='file'"]) == 2
  assert "prompt_file" in capsys.readouterr().err


@pytest.mark.slow
def test_the_python_entry_trains_and_returns_the_summary(tmp_path, capsys):
  import streamrl_jax

  settings = ["PipelineConfig.steps=1", "PipelineConfig.prompts_per_step=4", "PipelineConfig.group_size=2",
              "JobConfig.warmup_steps=0", "JobConfig.eval_prompts=4", "DemoModelConfig.hidden_size=32"]
  try:
    summary = streamrl_jax.train(DEMO_GIN, settings, tmp_path / "run")
  finally:
    gin_config.parse()
  written = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["steps"] == written["steps"] == 1 and summary["accuracy_after"] == written["accuracy_after"]
  assert summary["counters"]["samples_trained"] == 4 * 2
  err = capsys.readouterr().err
  assert "train_acc=" in err and " acc=" not in err  # the bar's accuracy is the training samples'


@pytest.mark.slow
def test_report_to_wandb_sends_every_row_and_the_pictures(tmp_path, monkeypatch):
  import wandb

  from tests.wandb_records import history

  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  args = ["train", "--config", DEMO_GIN, "--workdir", str(tmp_path), "--set", "PipelineConfig.steps=2",
          "--set", "PipelineConfig.prompts_per_step=4", "--set", "PipelineConfig.group_size=2",
          "--set", "JobConfig.warmup_steps=0", "--set", "JobConfig.eval_prompts=4", "--set", "DemoModelConfig.hidden_size=32",
          "--set", "JobConfig.report_to=('wandb',)"]
  try:
    assert cli.main(args) == 0
  finally:
    gin_config.parse()
    # run.finish() returns before wandb's service has closed the run's file (its last records may still be in a
    # buffer); a process's exit waits for that (wandb's atexit teardown), and so does this
    wandb.teardown()
  assert not (tmp_path / "tensorboard").exists()  # only what report_to names
  (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
  assert run_file.name == f"run-{(tmp_path / 'run_id').read_text().strip()}.wandb"  # the run's own id: resumable
  logged = history(run_file)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["_step"] for r in logged[:2]] == [1, 2]
  for sent, row in zip(logged, rows):
    assert sent["reward_mean"] == row["reward_mean"] and sent["accuracy"] == row["accuracy"]
  assert logged[-1]["curves/_type"] == logged[-1]["timeline/_type"] == "image-file"  # the pictures, at the last step
