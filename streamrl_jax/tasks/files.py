"""The user's own prompts: JSONL or Parquet rows (a file, or a directory of Parquet shards), through grain.

Every row is checked when the data is opened; a malformed row is an error naming the file and row. A row's
columns other than the prompt travel with it to the rewards (`Row.fields`). A fraction of the prompts can be
held out for evaluation by a stable hash of their text, so training never draws one.
`prompt_iterator` gives a grain iterator whose `get_state()` goes into checkpoints, so a resumed run
skips and repeats no prompt.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import grain

from streamrl_jax.rewards.verifiers import numeric_answer
from streamrl_jax.tasks.rows import Row

SPLITS = ("all", "train", "heldout")


def is_heldout(prompt: str, fraction: float) -> bool:
  """Whether `prompt` falls in the held-out `fraction` (CRC-32 of its text: the same on every machine and run)."""
  return zlib.crc32(prompt.encode()) / 2**32 < fraction


def _columns_hint(row) -> str:
  """"; its columns: [...]" and the one that likely holds the prompt, as the key that reads it."""
  if not isinstance(row, dict):
    return f"; the row is a {type(row).__name__}, not an object of columns"
  likely = [k for k in ("prompt", "question", "problem", "query", "input", "instruction") if k in row]
  return (f" (TaskConfig.prompt_key); its columns: {sorted(row)}"
          + (f"; for the prompt in {likely[0]!r}: TaskConfig.prompt_key='{likely[0]}'" if likely else ""))


def _is_conversation(value) -> bool:
  return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


class PromptFile:
  """A grain random-access source of {"prompt", "fields", "where"} records."""

  def __init__(self, path: str | os.PathLike, prompt_key: str = "question", answer_key: str | None = None,
               *, split: str = "all", heldout_fraction: float = 0.0):
    self.path = Path(path)
    if not self.path.exists():
      raise FileNotFoundError(f"prompt file {self.path} not found")
    if split not in SPLITS or not 0.0 <= heldout_fraction < 1.0:
      raise ValueError(f"PromptFile: split must be one of {list(SPLITS)} and heldout_fraction in [0, 1), got "
                       f"{split!r}, {heldout_fraction}")
    self.prompt_key = prompt_key
    self._records = []
    for name, i, row in self._rows():
      where = f"{name}, row {i}"
      if not isinstance(row, dict) or prompt_key not in row:
        raise ValueError(f"{where}: missing field {prompt_key!r}{_columns_hint(row)}")
      if answer_key is not None and answer_key not in row:
        raise ValueError(f"{where}: missing field {answer_key!r}")
      prompt = row[prompt_key]
      if _is_conversation(prompt):
        raise ValueError(f"{where}: field {prompt_key!r} is a conversation (TRL's conversational form); here a "
                         "prompt is the user's text: give that text and set TaskConfig.chat=True (the model's chat "
                         "template wraps it; TaskConfig.system_prompt for a system message)")
      if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field {prompt_key!r} must be non-empty text")
      fields = {k: v for k, v in row.items() if k != prompt_key}
      try:
        json.dumps(fields, allow_nan=False)
      except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: a column cannot be handed to a reward function as JSON ({err})") from None
      if split == "all" or is_heldout(prompt, heldout_fraction) == (split == "heldout"):
        self._records.append({"prompt": prompt, "fields": fields, "where": where, "row": i})
    if not self._records:
      held = f" in its {split!r} split (heldout fraction {heldout_fraction})" if split != "all" else ""
      raise ValueError(f"{self.path} holds no rows{held}")

  def _rows(self):
    """(file name, row number from 1, row) of every row, shards in name order."""
    if self.path.is_dir():
      shards = sorted(p for p in self.path.iterdir() if p.suffix in (".parquet", ".jsonl"))
      if not shards:
        raise ValueError(f"{self.path} is a directory without .parquet or .jsonl files")
    else:
      shards = [self.path]
    for shard in shards:
      for i, row in enumerate(self._read(shard), start=1):
        yield shard.name if shard != self.path else str(shard), i, row

  @staticmethod
  def _read(path: Path) -> list:
    if path.suffix == ".parquet":
      import pyarrow.parquet as pq

      return pq.read_table(path).to_pylist()
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as err:
          raise ValueError(f"{path}, row {i}: not valid JSON ({err.msg})") from None
    return rows

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict:
    return self._records[index]


def prompt_iterator(source, *, seed: int = 0, epochs: int | None = None):
  """A resumable grain iterator over `source`, shuffled per epoch (None: forever)."""
  dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat(epochs)
  return iter(dataset.to_iter_dataset())


def numeric_answer_reward(answer: str, completion: str, tolerance: float = 1e-6) -> float:
  """1.0 if the completion's final number equals the reference answer's number (the older name)."""
  return numeric_answer("", completion, answer, tolerance)


class FileTask:
  """The pipeline's task interface over a `PromptFile`: each step's prompts are drawn from the file by
  the step's own RNG (so a resumed run draws the same ones); its own verifier compares the final number with
  the row's `answer_key` column."""

  def __init__(self, source: PromptFile, answer_key: str = "answer"):
    self.source, self.answer_key = source, answer_key

  def draw(self, rng) -> tuple[str, Row]:
    record = self.source[int(rng.integers(len(self.source)))]
    return record["prompt"], Row(record["where"], record["fields"])

  def sample(self, rng) -> tuple[str, str]:
    prompt, row = self.draw(rng)
    return prompt, str(row.fields.get(self.answer_key, ""))

  def reward(self, prompt: str, completion: str, **fields) -> float:
    if self.answer_key not in fields:
      raise ValueError(f"the row has no {self.answer_key!r} column, which the built-in numeric verifier reads "
                       "(TaskConfig.answer_key; or name your own RewardConfig.functions)")
    return numeric_answer(prompt, completion, fields[self.answer_key])

  def missing_answer(self) -> str | None:
    """The first row without the answer column (None: every row has it)."""
    records = (self.source[i] for i in range(len(self.source)))
    return next((r["where"] for r in records if self.answer_key not in r["fields"]), None)
