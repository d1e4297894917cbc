"""save_hf / load_hf round trips through transformers, sharded checkpoints, and loading errors."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from streamrl_jax.models import ModelConfig, load_hf, save_hf

TOKENS = np.array([[3, 14, 15, 92, 65, 35, 89, 79]], np.int32)


@pytest.mark.parametrize("name", ["qwen2", "llama3_rope"])
def test_save_hf_is_loaded_by_transformers_with_same_logits(hf_dirs, tmp_path, name):
  directory, _ = hf_dirs[name]
  model = load_hf(directory)
  save_hf(model, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  with torch.no_grad():
    theirs = reloaded(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), theirs, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_round_trip(hf_dirs, tmp_path):
  model = load_hf(hf_dirs["qwen2"][0])
  save_hf(model, tmp_path, max_shard_bytes=40_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2
  again = load_hf(tmp_path)
  np.testing.assert_array_equal(np.asarray(again(jnp.asarray(TOKENS))), np.asarray(model(jnp.asarray(TOKENS))))


def test_bfloat16_load_keeps_dtype_and_is_close(hf_dirs):
  directory, _ = hf_dirs["llama"]
  f32 = load_hf(directory)
  bf16 = load_hf(directory, dtype=jnp.bfloat16)
  assert bf16.embed[...].dtype == jnp.bfloat16 and bf16.config.dtype == "bfloat16"
  np.testing.assert_allclose(np.asarray(bf16(jnp.asarray(TOKENS))), np.asarray(f32(jnp.asarray(TOKENS))),
                             atol=0.1)


def _copy(directory, tmp_path):
  target = tmp_path / "ckpt"
  shutil.copytree(directory, target)
  return target


def test_unknown_architecture_is_named(hf_dirs, tmp_path):
  target = _copy(hf_dirs["llama"][0], tmp_path)
  config = json.loads((target / "config.json").read_text())
  config["architectures"] = ["GPT2LMHeadModel"]
  (target / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported.*LlamaForCausalLM"):
    load_hf(target)


def _rewrite_tensors(target, edit):
  tensors = load_file(target / "model.safetensors")
  edit(tensors)
  save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_dirs, tmp_path):
  target = _copy(hf_dirs["qwen2"][0], tmp_path)
  _rewrite_tensors(target, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
    load_hf(target)


def test_shape_mismatch_names_tensor_and_both_shapes(hf_dirs, tmp_path):
  target = _copy(hf_dirs["qwen2"][0], tmp_path)

  def shrink(tensors):
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:16]
  _rewrite_tensors(target, shrink)
  with pytest.raises(ValueError, match=r"k_proj.weight.*\(16, 64\).*\(32, 64\)"):
    load_hf(target)


def test_unexpected_tensor_is_reported(hf_dirs, tmp_path):
  target = _copy(hf_dirs["qwen2"][0], tmp_path)
  _rewrite_tensors(target, lambda t: t.update({"model.layers.0.mlp.up_proj.bias": np.zeros(96, np.float32)}))
  with pytest.raises(ValueError, match="up_proj.bias"):
    load_hf(target)


def test_missing_config_and_bad_config_values(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(tmp_path)
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=3)
