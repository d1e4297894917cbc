"""Small GGUF files written by the tests themselves (random weights, quantized types, a byte-level BPE
tokenizer and a ChatML template), laid out as llama.cpp's converter writes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streamrl_jax.models.gguf import permute_rows

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a test model.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 64, 4, 2, 16, 96, 2


def byte_alphabet() -> list[str]:
  """GPT-2's printable spelling of the 256 bytes (what byte-level BPE vocabularies are written in)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
  codes, extra = list(keep), 0
  for b in range(256):
    if b not in keep:
      keep.append(b)
      codes.append(256 + extra)
      extra += 1
  return [chr(c) for _, c in sorted(zip(keep, codes))]


def vocabulary() -> list[str]:
  return SPECIALS + byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]


def hf_tensors(arch: str, vocab: int, seed: int, tied: bool) -> dict[str, np.ndarray]:
  """Random tensors under Hugging Face names and layouts."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
  out = {"model.embed_tokens.weight": normal(vocab, HIDDEN), "model.norm.weight": 1 + normal(HIDDEN)}
  if not tied:
    out["lm_head.weight"] = normal(vocab, HIDDEN)
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    out.update({p + "input_layernorm.weight": 1 + normal(HIDDEN), p + "post_attention_layernorm.weight": 1 + normal(HIDDEN),
                p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": normal(MLP, HIDDEN), p + "mlp.up_proj.weight": normal(MLP, HIDDEN),
                p + "mlp.down_proj.weight": normal(HIDDEN, MLP)})
    if arch == "qwen2":
      for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        out[p + f"self_attn.{name}_proj.bias"] = normal(rows * HEAD_DIM)
  return out


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf: str) -> str:
  top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
  if hf in top:
    return top[hf]
  _, _, index, rest = hf.split(".", 3)
  return f"blk.{index}.{_GGUF_NAMES[rest]}"


def write_gguf(path: Path, *, arch: str = "llama", quant: str = "Q8_0", seed: int = 0, tied: bool = True,
               pre: str = "default", tokens: list[str] | None = None, int8_tensor: str | None = None,
               architecture_name: str | None = None, add_bos: bool | None = None) -> Path:
  """A GGUF file: 2D weights in `quant` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0), norms and biases in F32,
  Q and K rows permuted as llama.cpp does for llama; `int8_tensor` (a Hugging Face name) is written as I8."""
  import gguf
  from gguf import quants

  tokens = vocabulary() if tokens is None else tokens
  vocab = len(vocabulary())
  writer = gguf.GGUFWriter(str(path), architecture_name or arch)
  writer.add_block_count(LAYERS)
  writer.add_context_length(256)
  writer.add_embedding_length(HIDDEN)
  writer.add_feed_forward_length(MLP)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  writer.add_key_length(HEAD_DIM)
  writer.add_value_length(HEAD_DIM)
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  writer.add_token_merges(MERGES)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(0)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  writer.add_chat_template(CHATML)
  for name, array in hf_tensors(arch, vocab, seed, tied).items():
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      array = permute_rows(array, HEADS if "q_proj" in name else KV_HEADS)
    kind = gguf.GGMLQuantizationType[quant] if array.ndim == 2 else gguf.GGMLQuantizationType.F32
    if name == int8_tensor:
      writer.add_tensor(gguf_name(name), (10 * array).astype(np.int8))
    elif kind == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(gguf_name(name), array)
    elif kind == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(gguf_name(name), array.astype(np.float16))
    else:
      data = quants.quantize(array, kind)
      writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=kind)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path
