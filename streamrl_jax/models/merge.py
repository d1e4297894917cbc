"""`streamrl merge BASE ADAPTER OUT`: a base model with a PEFT LoRA adapter merged in, as a Hugging Face directory
(the base's tokenizer files copied beside it), loadable by `load_hf` and by transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

from flax import nnx

from streamrl_jax.models import lora
from streamrl_jax.models.catalog import resolve_model
from streamrl_jax.models.hf_io import load_hf, save_hf
from streamrl_jax.models.peft_io import load_adapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


def merge_adapter(base: str, adapter: str, out: str) -> Path:
  """Writes `out`: the model `base` (a catalog name, .gguf or HF directory) with the adapter at `adapter` merged
  (W + alpha / r * A @ B, in the base's dtype). The adapter is checked against the base before anything is
  written."""
  base_dir = resolve_model(base)
  model = load_hf(base_dir)
  config, arrays = load_adapter(adapter, model.config, base)
  out = Path(out)
  if out.resolve() == Path(base_dir).resolve():
    raise ValueError(f"merge: OUT {out} is the base's own directory; name another")
  graphdef, params = nnx.split(model)
  save_hf(nnx.merge(graphdef, lora.merge(params, arrays, config.scale)), out)
  for name in TOKENIZER_FILES:
    if (Path(base_dir) / name).is_file():
      shutil.copy2(Path(base_dir) / name, out / name)
  return out
