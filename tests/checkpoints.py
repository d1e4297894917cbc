"""Small Hugging Face checkpoints that tests build from the tiny ones."""

from __future__ import annotations

import json


def word_checkpoint(hf_dirs, model_dir):
  """The tiny Qwen2 checkpoint with a word-level tokenizer of "what is A plus B ?" prompts."""
  import shutil

  import tokenizers
  shutil.copytree(hf_dirs["qwen2"][0], model_dir)
  words = ["<pad>", "</s>", "[UNK]", "what", "is", "plus", "?"] + [str(d) for d in range(10)]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<pad>", "</s>"])
  tok.save(str(model_dir / "tokenizer.json"))
  (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
  return model_dir


def hub_layout(cache, repo: str, snapshots: dict, refs: dict, kind: str = "model") -> None:
  """A Hugging Face Hub cache under `cache` as huggingface_hub writes one: `snapshots` maps a commit (40 hex
  digits) to a directory whose files (folders included) it holds as links into content-addressed blobs, `refs` a
  branch or tag to a commit; `kind` "model" or "dataset"."""
  import hashlib
  import os
  from pathlib import Path

  folder = Path(cache) / f"{kind}s--{repo.replace('/', '--')}"
  (folder / "blobs").mkdir(parents=True, exist_ok=True)
  for commit, source in snapshots.items():
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(p for p in Path(source).rglob("*") if p.is_file()):
      data = file.read_bytes()
      blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
      blob.write_bytes(data)
      link = snapshot / file.relative_to(source)
      link.parent.mkdir(parents=True, exist_ok=True)
      os.symlink(os.path.relpath(blob, link.parent), link)
  for ref, commit in refs.items():
    (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)


def write_parquet(path, rows: list[dict]) -> None:
  """`rows` as a Parquet file at `path` (its folders made)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)
