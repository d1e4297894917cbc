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
