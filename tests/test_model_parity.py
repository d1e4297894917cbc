"""Logits (padded and packed rows), KV-cache decoding and greedy generation against Hugging Face transformers, for
every family: Llama (with Llama 3 rope scaling), Qwen2, Qwen3, Qwen3-MoE and Gemma 3 (sliding layers of window 4)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from streamrl_jax.models import KVCache, generate, load_hf, pad_prompts

PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4, 60, 61, 62, 70, 3, 11], [7, 7, 90, 12, 13, 14, 15, 16, 40, 41, 42, 43]]
MODELS = ["qwen2", "llama", "llama3_rope", "qwen3", "qwen3_moe", "gemma3"]


def hf_logits(hf_model, prompt):
  with torch.no_grad():
    return hf_model(torch.tensor([prompt])).logits[0].numpy()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_logits_match_transformers(hf_dirs, name, side):
  directory, hf_model = hf_dirs[name]
  model = load_hf(directory, dtype=jnp.float32)
  tokens, mask = pad_prompts(PROMPTS, pad_id=0, side=side)
  logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
  for row, prompt in enumerate(PROMPTS):
    np.testing.assert_allclose(logits[row][mask[row]], hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_packed_rows_keep_each_sample_to_itself(hf_dirs):
  """Prompts end to end in one row (segment ids, positions restarting; a sliding layer's window within its own
  sample): each one's logits are transformers' for the prompt alone."""
  tokens = np.concatenate([np.asarray(p) for p in PROMPTS])[None]
  segments = np.concatenate([np.full(len(p), i + 1) for i, p in enumerate(PROMPTS)])[None]
  tokens, segments = np.pad(tokens, ((0, 0), (0, 3))), np.pad(segments, ((0, 0), (0, 3)))  # padding at the end
  for name in MODELS:
    directory, hf_model = hf_dirs[name]
    logits = np.asarray(load_hf(directory)(jnp.asarray(tokens), jnp.asarray(segments > 0), jnp.asarray(segments)))
    for i, prompt in enumerate(PROMPTS):
      np.testing.assert_allclose(logits[0][segments[0] == i + 1], hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4,
                                 err_msg=name)


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3_moe", "gemma3"])
def test_kv_cache_decoding_equals_full_forward(hf_dirs, name):
  model = load_hf(hf_dirs[name][0])
  full_tokens, full_mask = pad_prompts(PROMPTS, pad_id=0, side="left")
  full = np.asarray(model(jnp.asarray(full_tokens), jnp.asarray(full_mask)))
  prefix = 4  # prefill the first 4 columns as a chunk, then one token at a time
  cache = KVCache.init(model.config, len(PROMPTS), full_tokens.shape[1] + 2)
  logits, cache = model.forward_with_cache(jnp.asarray(full_tokens[:, :prefix]), cache,
                                           jnp.asarray(full_mask[:, :prefix]))
  steps = [np.asarray(logits)]
  for col in range(prefix, full_tokens.shape[1]):
    logits, cache = model.forward_with_cache(jnp.asarray(full_tokens[:, col:col + 1]), cache,
                                             jnp.asarray(full_mask[:, col:col + 1]))
    steps.append(np.asarray(logits))
  incremental = np.concatenate(steps, axis=1)
  np.testing.assert_allclose(incremental[full_mask], full[full_mask], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(cache.next_position), full_mask.sum(1))
  at = np.array([11, 7, 5])  # one real token of each row: the head runs there alone
  picked, _ = model.forward_with_cache(jnp.asarray(full_tokens), KVCache.init(model.config, len(PROMPTS), 14),
                                       jnp.asarray(full_mask), logits_at=jnp.asarray(at))
  np.testing.assert_allclose(np.asarray(picked)[:, 0], full[np.arange(len(PROMPTS)), at], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_transformers_generate(hf_dirs, name):
  directory, hf_model = hf_dirs[name]
  model = load_hf(directory)
  tokens, mask = pad_prompts(PROMPTS, pad_id=0, side="left")
  ours = generate(model, tokens, mask, max_new_tokens=32)
  for row, prompt in enumerate(PROMPTS):
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              pad_token_id=0)
    np.testing.assert_array_equal(ours[row], ref[0, len(prompt):].numpy(), err_msg=f"{name} row {row}")
