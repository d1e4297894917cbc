"""The user's own prompts: JSONL or Parquet rows with a prompt and an answer field, through grain.

Every row is checked when the file is opened; a malformed row is an error naming the file and row.
`prompt_iterator` gives a grain iterator whose `get_state()` goes into checkpoints, so a resumed run
skips and repeats no prompt.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import grain

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class PromptFile:
  """A grain random-access source of {"prompt", "answer", "row"} records."""

  def __init__(self, path: str | os.PathLike, prompt_key: str = "question", answer_key: str = "answer"):
    self.path = Path(path)
    if not self.path.exists():
      raise FileNotFoundError(f"prompt file {self.path} not found")
    rows = self._read()
    self._records = []
    for i, row in enumerate(rows, start=1):
      for key in (prompt_key, answer_key):
        if not isinstance(row, dict) or key not in row:
          raise ValueError(f"{self.path}, row {i}: missing field {key!r}")
      if not isinstance(row[prompt_key], str) or not row[prompt_key].strip():
        raise ValueError(f"{self.path}, row {i}: field {prompt_key!r} must be non-empty text")
      self._records.append({"prompt": row[prompt_key], "answer": str(row[answer_key]), "row": i})
    if not self._records:
      raise ValueError(f"{self.path} holds no rows")

  def _read(self) -> list:
    if self.path.suffix == ".parquet":
      try:
        import pyarrow.parquet as pq
      except ImportError as err:
        raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from err
      return pq.read_table(self.path).to_pylist()
    rows = []
    for i, line in enumerate(self.path.read_text().splitlines(), start=1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as err:
          raise ValueError(f"{self.path}, row {i}: not valid JSON ({err.msg})") from None
    return rows

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict:
    return self._records[index]


def prompt_iterator(source, *, seed: int = 0, epochs: int | None = None):
  """A resumable grain iterator over `source`, shuffled per epoch (None: forever)."""
  dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat(epochs)
  return iter(dataset.to_iter_dataset())


def extract_answer(text: str) -> float | None:
  """The number after `####` (GSM8K), else the last number in the text."""
  tail = text.split("####")[-1]
  found = _NUMBER.findall(tail)
  return float(found[-1].replace(",", "")) if found else None


def numeric_answer_reward(answer: str, completion: str, tolerance: float = 1e-6) -> float:
  """1.0 if the completion's final number equals the reference answer's number."""
  expected = extract_answer(answer)
  if expected is None:
    raise ValueError(f"reference answer {answer!r} holds no number")
  got = extract_answer(completion)
  return float(got is not None and abs(got - expected) <= tolerance * max(1.0, abs(expected)))


class FileTask:
  """The pipeline's task interface over a `PromptFile`: each step's prompts are drawn from the file by
  the step's own RNG (so a resumed run draws the same ones), rewards by the numeric-answer verifier."""

  def __init__(self, source: PromptFile):
    self.source = source
    self._answers = {source[i]["prompt"]: source[i]["answer"] for i in range(len(source))}

  def sample(self, rng) -> tuple[str, str]:
    record = self.source[int(rng.integers(len(self.source)))]
    return record["prompt"], record["answer"]

  def reward(self, prompt: str, completion: str) -> float:
    return numeric_answer_reward(self._answers[prompt], completion)
