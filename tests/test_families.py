"""The families a user brings (Qwen3, Qwen3-MoE, Gemma 3) as checkpoints: config.json read and written back, saved
weights transformers loads with the same logits, sharded files by Hub id from an offline cache, and what this decoder
lacks refused by name when the config is read."""

import json
import shutil
import socket

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from streamrl_jax.models import load_hf, save_hf
from streamrl_jax.models.catalog import resolve_model
from streamrl_jax.models.families import UnsupportedModel, config_from_hf, config_to_hf
from tests.checkpoints import hub_layout
from tests.conftest import FAMILY_CONFIGS

TOKENS = np.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]], np.int32)
NEW = list(FAMILY_CONFIGS)


def their_logits(model, tokens=TOKENS):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", NEW)
def test_saved_weights_load_in_transformers_with_the_same_logits(hf_dirs, tmp_path, name):
  directory, hf_model = hf_dirs[name]
  model = load_hf(directory)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), their_logits(hf_model), atol=1e-4, rtol=1e-4)
  save_hf(model, tmp_path / "out", max_shard_bytes=60_000)  # sharded, with an index
  assert (tmp_path / "out" / "model.safetensors.index.json").exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded) is type(hf_model)
  np.testing.assert_allclose(their_logits(reloaded), their_logits(hf_model), atol=1e-5, rtol=1e-5)
  assert reloaded.num_parameters() == model.config.param_count() == hf_model.num_parameters()


@pytest.mark.parametrize("name", NEW)
def test_config_json_round_trips_through_our_config(hf_dirs, name):
  hf = json.loads((hf_dirs[name][0] / "config.json").read_text())
  ours = config_from_hf(hf)
  assert config_from_hf(config_to_hf(ours)) == ours
  theirs = transformers.AutoConfig.for_model(**{k: v for k, v in config_to_hf(ours).items() if k != "model_type"},
                                             model_type=config_to_hf(ours)["model_type"])
  assert theirs.num_hidden_layers == ours.num_layers and theirs.head_dim == ours.head_dim


def test_each_switch_is_read_from_its_family(hf_dirs):
  qwen3, moe, gemma = (config_from_hf(json.loads((hf_dirs[n][0] / "config.json").read_text())) for n in NEW)
  assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 24 and not qwen3.num_experts
  assert moe.moe_layers == (0, 2) and moe.experts_per_token == 2 and moe.norm_topk_prob
  assert gemma.windows == (4, None, 4) and gemma.layer_rope(0) == (1e4, None)
  assert gemma.layer_rope(1)[1].rope_type == "linear" and gemma.layer_rope(1)[1].factor == 2.0
  assert gemma.norm_offset == 1.0 and gemma.sandwich_norms and gemma.embed_scale and gemma.tie_embeddings
  assert gemma.hidden_act == "gelu_tanh" and gemma.query_scale == pytest.approx(24 ** -0.5)
  # a Hub config of the older form: the pattern and the local base as keys of their own
  old = dict(architectures=["Gemma3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
             num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=4, sliding_window=512,
             sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None,
             query_pre_attn_scalar=4)
  assert config_from_hf(old).layer_types == ("sliding",) * 5 + ("full", "sliding")
  assert config_from_hf(old).tie_embeddings  # the Hub's gemma-3-1b-it states none: Gemma's default, tied
  dense = json.loads((hf_dirs["qwen3_moe"][0] / "config.json").read_text())
  dense.pop("num_local_experts", None)
  assert not config_from_hf({**dense, "num_experts": 0}).moe_layers  # a Qwen3-MoE config with no experts: dense
  qwen_sliding = dict(architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                      num_hidden_layers=4, num_attention_heads=2, use_sliding_window=True, sliding_window=64,
                      max_window_layers=2)
  assert config_from_hf(qwen_sliding).windows == (None, None, 64, 64)


def test_a_hub_id_of_each_family_loads_offline_from_sharded_files(hf_dirs, tmp_path, monkeypatch):
  cache = tmp_path / "hub"
  commit = "c" * 40
  for name, repo in zip(NEW, ("Qwen/Qwen3-tiny", "Qwen/Qwen3-tiny-A1B", "google/gemma-3-tiny-it")):
    sharded = tmp_path / name
    save_hf(load_hf(hf_dirs[name][0]), sharded, max_shard_bytes=50_000)
    hub_layout(cache, repo, {commit: sharded}, {"main": commit})
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")

  def refused(*args, **kwargs):
    raise AssertionError(f"a connection was opened under HF_HUB_OFFLINE=1: {args}")
  monkeypatch.setattr(socket.socket, "connect", refused)
  for name, repo in zip(NEW, ("Qwen/Qwen3-tiny", "Qwen/Qwen3-tiny-A1B", "google/gemma-3-tiny-it")):
    path = resolve_model(repo)
    assert len(list(path.glob("*.safetensors"))) > 1
    np.testing.assert_allclose(np.asarray(load_hf(path)(jnp.asarray(TOKENS))), their_logits(hf_dirs[name][1]),
                               atol=1e-4, rtol=1e-4, err_msg=repo)


def _edited(hf_dirs, tmp_path, name, **changes):
  target = tmp_path / name
  shutil.copytree(hf_dirs[name][0], target)
  config = json.loads((target / "config.json").read_text())
  config.update(changes)
  (target / "config.json").write_text(json.dumps(config))
  return target


@pytest.mark.parametrize("name, changes, refusal", [
    ("gemma3", dict(architectures=["Gemma3ForConditionalGeneration"]), r"vision tower .* text-only"),
    ("gemma3", dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30.0: logit soft-capping"),
    ("gemma3", dict(use_bidirectional_attention=True), r"use_bidirectional_attention"),
    ("qwen3", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)),
     r"rope_type 'yarn', which is not implemented; implemented: default, llama3, linear"),
    ("qwen3", dict(hidden_act="relu"), r"hidden_act 'relu' is not implemented"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), r"use_sliding_window=true for a Qwen3-MoE"),
])
def test_what_the_decoder_lacks_is_refused_by_name_before_the_weights(hf_dirs, tmp_path, name, changes, refusal):
  target = _edited(hf_dirs, tmp_path, name, **changes)
  (target / "model.safetensors").unlink()  # refused from config.json alone
  with pytest.raises(UnsupportedModel, match=refusal):
    load_hf(target)
