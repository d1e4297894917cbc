"""The metrics table (`records/metric_table.py`, shown in docs/metrics.md): every key a row holds is listed (the
suite runs with STREAMRL_STRICT_METRICS=1, so a run writing an unlisted key fails), and every listed key is written
by some part of the package."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from streamrl_jax.records import metric_table
from streamrl_jax.records.metric_table import METRICS, check_row, unlisted

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamrl_jax"


def written_names(source: str) -> tuple[set[str], set[str]]:
  """(plain names a source can write as row keys: string constants, call keywords and dataclass fields; the
  leading constant parts of its f-strings)."""
  plain, leads = set(), set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      plain.add(node.value)
    elif isinstance(node, ast.keyword) and node.arg:
      plain.add(node.arg)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      plain.add(node.target.id)
    elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
      leads.add(node.values[0].value)
  return plain, leads


def test_the_checks_tell_listed_from_unlisted():
  assert unlisted({"step": 1, "reward/task": 0.5, "trainer_s/optimizer": 0.1, "ranker_spearman": 0.2}) == []
  assert unlisted({"step": 1, "kl_mean": 0.0, "step_wall_s": 1.0}) == ["kl_mean", "step_wall_s"]
  assert written_names('d = dict(a=1, **{"b": 2}); e = f"c/{x}"') == ({"a", "b", "c/"}, {"c/"})


def test_an_unlisted_key_fails_a_strict_run_and_is_logged_otherwise(monkeypatch, caplog):
  monkeypatch.setenv(metric_table.STRICT_ENV, "1")
  with pytest.raises(ValueError, match="max_token_staleness"):
    check_row({"step": 1, "max_token_staleness": 2})
  monkeypatch.setenv(metric_table.STRICT_ENV, "0")
  row = {"step": 1, "an_unlisted_key": 2}
  assert check_row(row) is row
  assert "an_unlisted_key" in caplog.text


def test_the_suite_runs_strict():
  assert os.environ.get(metric_table.STRICT_ENV) == "1"


def test_every_listed_key_is_written_somewhere():
  plain, leads = set(), set()
  for path in PACKAGE.rglob("*.py"):
    if path.name != "metric_table.py":
      more_plain, more_leads = written_names(path.read_text())
      plain |= more_plain
      leads |= more_leads
  never = [m.name for m in METRICS if (m.prefix is None and m.name not in plain)
           or (m.prefix is not None and m.prefix not in leads)]
  assert never == []


def test_names_are_unique_and_kinds_known():
  names = [m.name for m in METRICS]
  assert len(names) == len(set(names))
  assert {m.kind for m in METRICS} <= {"int", "float", "str"}


def test_docs_show_the_generated_table():
  text = (ROOT / "docs" / "metrics.md").read_text()
  assert metric_table.markdown() in text, "docs/metrics.md: regenerate the table with " \
                                          "`python -m streamrl_jax.records.metric_table`"


def test_a_row_is_joined_from_parts_each_writing_only_its_own_keys(monkeypatch):
  """`join_row`: a new row from each part's keys; another part's key, a key twice, an unlisted key are refused."""
  from streamrl_jax.records.metric_table import ARMS, EVALUATION, STEP, UPDATE, join_row, owner_of

  monkeypatch.setenv(metric_table.STRICT_ENV, "1")
  base = join_row({STEP: {"step": 3, "trainer_s/optimizer": 0.5}, UPDATE: {"loss": 1.0}})
  assert base == {"step": 3, "trainer_s/optimizer": 0.5, "loss": 1.0}
  row = join_row({ARMS: {"arm": "b"}, EVALUATION: {"heldout_accuracy": 0.25}}, base)
  assert row == {**base, "arm": "b", "heldout_accuracy": 0.25} and "arm" not in base  # base untouched
  assert owner_of("reward/task") == STEP and owner_of("is_ratio_q50") == UPDATE and owner_of("nope") is None
  with pytest.raises(ValueError, match="'loss' is the update's .* but the arms wrote it"):
    join_row({ARMS: {"loss": 2.0}}, base)
  with pytest.raises(ValueError, match="'step' was written twice"):
    join_row({STEP: {"step": 4}}, base)
  with pytest.raises(ValueError, match="'not_a_metric' .* is not in"):
    join_row({STEP: {"not_a_metric": 1}})
  monkeypatch.setenv(metric_table.STRICT_ENV, "0")
  assert join_row({ARMS: {"loss": 2.0}}, base)["loss"] == 2.0  # logged, not fatal, outside the suite
