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


EXPERTS, EXPERTS_USED, EXPERT_MLP, WINDOW = 4, 2, 32, 4  # the qwen3moe and gemma3 files' own sizes


def hf_tensors(arch: str, vocab: int, seed: int, tied: bool) -> dict[str, np.ndarray]:
  """Random tensors under Hugging Face names and layouts (a mixture's experts one tensor each, as transformers saves
  them; Gemma's norm weights as offsets from 1)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
  norm = (lambda: normal(HIDDEN)) if arch == "gemma3" else (lambda: 1 + normal(HIDDEN))  # noqa: E731
  norms = (("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
           if arch == "gemma3" else ("input_layernorm", "post_attention_layernorm"))
  out = {"model.embed_tokens.weight": normal(vocab, HIDDEN), "model.norm.weight": norm()}
  if not tied:
    out["lm_head.weight"] = normal(vocab, HIDDEN)
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    out.update({p + f"{n}.weight": norm() for n in norms})
    out.update({p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM)})
    if arch in ("qwen3", "qwen3moe", "gemma3"):
      out.update({p + "self_attn.q_norm.weight": normal(HEAD_DIM) + (arch != "gemma3"),
                  p + "self_attn.k_norm.weight": normal(HEAD_DIM) + (arch != "gemma3")})
    if arch == "qwen3moe":
      out[p + "mlp.gate.weight"] = 5 * normal(EXPERTS, HIDDEN)
      for e in range(EXPERTS):
        out.update({p + f"mlp.experts.{e}.gate_proj.weight": normal(EXPERT_MLP, HIDDEN),
                    p + f"mlp.experts.{e}.up_proj.weight": normal(EXPERT_MLP, HIDDEN),
                    p + f"mlp.experts.{e}.down_proj.weight": normal(HIDDEN, EXPERT_MLP)})
    else:
      out.update({p + "mlp.gate_proj.weight": normal(MLP, HIDDEN), p + "mlp.up_proj.weight": normal(MLP, HIDDEN),
                  p + "mlp.down_proj.weight": normal(HIDDEN, MLP)})
    if arch == "qwen2":
      for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        out[p + f"self_attn.{name}_proj.bias"] = normal(rows * HEAD_DIM)
  return out


def gguf_tensors(arch: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The same tensors under llama.cpp's names (the gguf package's map) and conventions: a mixture's experts stacked
  into one tensor [experts, ...], Gemma's norms stored as 1 + weight, llama's Q and K rows permuted."""
  import gguf

  names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), LAYERS)
  out, experts = {}, {}
  for hf, array in tensors.items():
    base, suffix = hf.rsplit(".", 1)
    if ".experts." in base:
      _, _, layer, _, _, expert, proj = base.split(".")
      stacked = f"{names.get_name(f'model.layers.{layer}.mlp.experts.{proj}')}.{suffix}"
      experts.setdefault(stacked, {})[int(expert)] = array
      continue
    if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
      array = permute_rows(array, HEADS if "q_proj" in hf else KV_HEADS)
    if arch == "gemma3" and "norm" in hf:
      array = array + 1
    out[f"{names.get_name(base)}.{suffix}"] = array
  out.update({name: np.stack([parts[e] for e in sorted(parts)]) for name, parts in experts.items()})
  return out


def hf_config(arch: str, vocab: int, tied: bool) -> dict:
  """config.json of the Hugging Face model the file's tensors make (transformers' reference for the new families)."""
  common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=tied, max_position_embeddings=256)
  return {"qwen3": dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
          "qwen3moe": dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=EXPERTS,
                           num_experts_per_tok=EXPERTS_USED, moe_intermediate_size=EXPERT_MLP, norm_topk_prob=True),
          "gemma3": dict(common, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=HEAD_DIM,
                         rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=2.0),
                         hidden_activation="gelu_pytorch_tanh")}[arch]


def _family_metadata(writer, arch: str) -> None:
  if arch == "qwen3moe":
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(EXPERTS_USED)
    writer.add_expert_feed_forward_length(EXPERT_MLP)
  if arch == "gemma3":
    import gguf

    writer.add_sliding_window(WINDOW)
    writer.add_sliding_window_pattern([True, False])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)


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
  _family_metadata(writer, arch)
  int8_name = None if int8_tensor is None else next(iter(gguf_tensors(arch, {int8_tensor: np.zeros((1, 1))})))
  for name, array in gguf_tensors(arch, hf_tensors(arch, vocab, seed, tied)).items():
    kind = gguf.GGMLQuantizationType[quant] if array.ndim >= 2 else gguf.GGMLQuantizationType.F32
    if name == int8_name:
      writer.add_tensor(name, (10 * array).astype(np.int8))
    elif kind == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, array)
    elif kind == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(name, array.astype(np.float16))
    else:
      data = quants.quantize(array, kind)
      writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path
