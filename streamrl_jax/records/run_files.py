"""The files a run leaves in its workdir besides its metrics, record and pictures: their names, and the writers of
settings.json, config.gin, the held-out evaluations' rows, the accuracy before RL, summary.json, arm.json and the
saved models (a run's, and each arm's under WORKDIR/arms/NAME)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from streamrl_jax.models import save_hf
from streamrl_jax.models.lora import LoraConfig
from streamrl_jax.models.peft_io import save_adapter

SETTINGS_FILE = "settings.json"  # every setting flat, with what this machine made of 'auto': a resume checks it
CONFIG_FILE = "config.gin"  # the run's configuration, every key with its type and help: it runs again as is
SUMMARY_FILE = "summary.json"
ARM_FILE = "arm.json"  # what an arm trains with (the lead's too, in a run with arms)
BEFORE_FILE = "accuracy_before.json"  # the held-out accuracy before RL, measured once (a resume reads it)
EVAL_BEFORE, EVAL_AFTER = "eval_before.jsonl", "eval_after.jsonl"  # each held-out prompt's row
WARMUP_DIR = "warmup_model"  # the supervised warm-up's model, made once per workdir
FINAL_MODEL = "final_model"
FINAL_ADAPTER = "final_adapter"  # LoRA: the adapter alone, in the PEFT format


def replace_text(path: Path, text: str) -> None:
  """`path` holds `text`, whole or not at all: another process reading it meanwhile (a trainer's other processes read
  settings.json as process 0 writes it again on a resume) finds the old file or the new one, never a part."""
  tmp = Path(path).with_name(Path(path).name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def write_settings(workdir: Path, settings: dict[str, str]) -> None:
  replace_text(Path(workdir) / SETTINGS_FILE, json.dumps(settings, indent=1, sort_keys=True))


def read_settings(workdir: Path) -> dict[str, str] | None:
  path = Path(workdir) / SETTINGS_FILE
  return json.loads(path.read_text()) if path.exists() else None


def write_config(workdir: Path, text: str) -> None:
  replace_text(Path(workdir) / CONFIG_FILE, text)


def write_eval_rows(path: Path, rows: list[tuple[str, str, float]]) -> None:
  """A held-out evaluation's (prompt, completion, reward) rows as JSON lines."""
  Path(path).write_text("".join(json.dumps(dict(prompt=p, completion=c, reward=r)) + "\n" for p, c, r in rows))


def write_accuracy_before(workdir: Path, accuracy: float, at_k: dict[str, float] | None = None) -> None:
  """The held-out accuracy before RL, with its scores at k (`heldout_avg@K`, `heldout_pass@K`) where measured."""
  replace_text(Path(workdir) / BEFORE_FILE, json.dumps({"accuracy": accuracy, "at_k": at_k or {}}))


def read_accuracy_before(workdir: Path) -> float | None:
  """The held-out accuracy before RL measured in `workdir`; None when it was not (yet)."""
  path = Path(workdir) / BEFORE_FILE
  return json.loads(path.read_text())["accuracy"] if path.exists() else None


def read_at_k_before(workdir: Path) -> dict[str, float]:
  """The scores at k before RL measured in `workdir` (empty when none were)."""
  path = Path(workdir) / BEFORE_FILE
  return json.loads(path.read_text()).get("at_k", {}) if path.exists() else {}


def write_summary(directory: Path, summary: dict) -> None:
  replace_text(Path(directory) / SUMMARY_FILE, json.dumps(summary, indent=2))


def write_arm(directory: Path, description: dict) -> None:
  (Path(directory) / ARM_FILE).write_text(json.dumps(description, indent=1))


def save_model(model, directory: Path) -> None:
  save_hf(model, directory)


def save_final(workdir: Path, model, adapter: dict | None = None, lora: LoraConfig | None = None,
               base_id: str = "") -> None:
  """WORKDIR/final_model; with LoRA's `adapter` arrays, also the adapter alone as WORKDIR/final_adapter (PEFT
  format, on the base model `base_id`: `streamrl merge` rebuilds final_model from it)."""
  save_hf(model, Path(workdir) / FINAL_MODEL)
  if adapter is not None:
    save_adapter(Path(workdir) / FINAL_ADAPTER, adapter, lora, base_id)
