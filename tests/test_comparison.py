"""`streamrl compare RUN_DIR`: the arms of a run read back from its workdir, one table and one PNG."""

import json

import pytest

from streamrl_jax import cli
from streamrl_jax.records import run_files
from streamrl_jax.records.comparison import read_arms
from streamrl_jax.records.run_record import ARMS_DIR


def _arm(directory, name, divergences, after=None):
  directory.mkdir(parents=True, exist_ok=True)
  rows = [dict(step=s, reward_mean=0.1 * s, arm=name, arm_policy_divergence=d) for s, d in enumerate(divergences, 1)]
  (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  run_files.write_arm(directory, dict(advantage="grpo", objective="ppo_clip" if name == "lead" else "reinforce",
                                      learning_rate=1e-5))
  if after is not None:
    run_files.write_summary(directory, dict(accuracy_after=after))


def test_compare_reads_every_arm_and_writes_a_table_and_a_picture(tmp_path, capsys):
  _arm(tmp_path, "lead", [0.0, 0.02, 0.04], after=0.5)
  _arm(tmp_path / ARMS_DIR / "slow", "slow", [0.0, 0.01, 0.03])  # not finished: no summary yet
  run_files.write_accuracy_before(tmp_path, 0.25)
  arms = read_arms(tmp_path)
  assert [(a.name, len(a.rows), a.accuracy_before, a.accuracy_after) for a in arms] == [
      ("lead", 3, 0.25, 0.5), ("slow", 3, 0.25, None)]
  assert arms[1].tail("arm_policy_divergence") == pytest.approx((0.0 + 0.01 + 0.03) / 3)
  assert cli.main(["compare", str(tmp_path)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split()[:3] == ["arm", "advantage", "objective"]
  assert lines[1].split() == ["lead", "grpo", "ppo_clip", "1e-05", "3", "0", "0.020", "0.250", "0.500", "+0.250"]
  assert lines[2].split() == ["slow", "grpo", "reinforce", "1e-05", "3", "0", "0.013", "0.250", "-", "-"]
  assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_names_a_directory_that_holds_no_run(tmp_path):
  with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no metrics.jsonl"):
    read_arms(tmp_path)
