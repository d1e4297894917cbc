"""GGUF files (llama.cpp's format) in: hyperparameters, dequantized tensors, tokenizer and chat template.

`read_gguf` gives a `GGUFModel` whose tensors carry Hugging Face names and layouts, so `write_hf_dir`
turns it into a directory that `load_hf`, `load_tokenizer` and transformers all read. Tensors are
named by the `gguf` package's own map (llama, qwen2, qwen3, qwen3moe, gemma3) and dequantized to float32 by it;
llama.cpp's row permutation of the Q and K projections (its rotary layout, llama only) is undone, a mixture's
stacked experts are split into Hugging Face's one tensor per expert, and Gemma's norms, which llama.cpp stores
as 1 + weight, are stored as weights again. Every refusal is a `GGUFError` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from streamrl_jax.models.chat import end_of_turn_token
from streamrl_jax.models.tokenizer import special_post_processor
from streamrl_jax.models.config import ModelConfig, RopeScaling
from streamrl_jax.models.families import config_to_hf
from streamrl_jax.models.hf_io import tensor_layout

# general.architecture -> ModelConfig.architecture (the family)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                   "Q2_K", "Q3_K")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the splits its merges were learned with (llama.cpp's pre-tokenizer types).
PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,), "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,), "qwen2": (_QWEN2_SPLIT,),
}

class GGUFError(ValueError):
  """A GGUF file this project cannot use; the message names the file and the problem."""


@dataclasses.dataclass(frozen=True)
class GGUFModel:
  config: ModelConfig
  tensors: dict[str, np.ndarray]  # Hugging Face names and layouts, float32
  tokenizer: tokenizers.Tokenizer
  bos_token: str | None
  eos_token: str
  pad_token: str | None
  chat_template: str | None
  add_bos: bool = False  # tokenizer.ggml.add_bos_token: a raw prompt starts with BOS
  add_eos: bool = False


def tensor_names(arch: str, config: ModelConfig) -> dict[str, list[tuple[str, int | None]]]:
  """GGUF tensor name -> the Hugging Face tensors it holds, [(name, expert)]: one, or a mixture's stacked experts
  (expert e is slice e), for every tensor of `config`'s layout, named by the `gguf` package's tensor map."""
  import gguf

  names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_layers)
  out: dict[str, list[tuple[str, int | None]]] = {}
  for spec in tensor_layout(config):
    base, suffix = spec.hf_name.rsplit(".", 1)
    if spec.expert is not None:  # model.layers.N.mlp.experts.E.gate_proj -> model.layers.N.mlp.experts.gate_proj
      base = base.replace(f".experts.{spec.expert}.", ".experts.")
    name = names.get_name(base)
    if name is None:
      raise GGUFError(f"the gguf package names no {arch} tensor for {spec.hf_name!r}")
    out.setdefault(f"{name}.{suffix}", []).append((spec.hf_name, spec.expert))
  return out


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's permutation of a Q or K projection [heads * head_dim, ...]: within each head it
  interleaves the two rotary halves; Hugging Face keeps them apart (rotate-half)."""
  half = weight.shape[0] // heads // 2
  return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's permutation (what its converter writes); the inverse of `unpermute_rows`."""
  half = weight.shape[0] // heads // 2
  return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _open(path: Path):
  import gguf

  if not path.is_file():
    raise GGUFError(f"{path}: no such file")
  with path.open("rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as err:  # the reader raises ValueError, IndexError, struct errors on a cut file
    raise GGUFError(f"{path}: unreadable GGUF, truncated or corrupt ({type(err).__name__}: {err})") from None


def _field(reader, path: Path, key: str, default=None, required: bool = False):
  field = reader.fields.get(key)
  if field is None:
    if required:
      raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return default
  return field.contents()


def read_config(reader, path: Path) -> ModelConfig:
  """The decoder's `ModelConfig` from the file's metadata (weights not read)."""
  arch = _field(reader, path, "general.architecture", required=True)
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: {list(ARCHITECTURES)}")
  family = ARCHITECTURES[arch]
  get = lambda key, default=None, required=False: _field(reader, path, f"{arch}.{key}", default, required)  # noqa: E731
  names = set(_tensor_names(reader))
  scaling = get("rope.scaling.type", "none")
  if scaling not in ("none", None) and not (family == "gemma3" and scaling == "linear") or "rope_freqs.weight" in names:
    raise GGUFError(f"{path}: rope scaling ({get('rope.scaling.type', 'rope_freqs')}) is not supported")
  hidden, heads = int(get("embedding_length", required=True)), int(get("attention.head_count", required=True))
  tokens = _field(reader, path, "tokenizer.ggml.tokens")
  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embed is None:
    raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
  vocab = int(embed.shape[-1])
  if tokens is not None and len(tokens) != vocab:
    raise GGUFError(f"{path}: the tokenizer has {len(tokens)} tokens but the embedding has {vocab} rows")
  eos = _field(reader, path, "tokenizer.ggml.eos_token_id")
  bos = _field(reader, path, "tokenizer.ggml.bos_token_id")
  layers = int(get("block_count", required=True))
  head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
  fields = dict(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length", required=True)),
      num_layers=layers, num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
      architecture=family, rope_theta=float(get("rope.freq_base", 10000.0)),
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), qkv_bias=family == "qwen2",
      tie_embeddings="output.weight" not in names, max_position_embeddings=int(get("context_length", 4096)),
      bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos))
  fields.update(_family_fields(family, get, names, layers, head_dim))
  return ModelConfig(**fields)


def _family_fields(family: str, get, names: set, layers: int, head_dim: int) -> dict:
  """The switches of a qwen3, qwen3moe or gemma3 file, from its metadata as llama.cpp writes and reads it."""
  if family in ("qwen3", "qwen3_moe"):
    fields = dict(qk_norm=True)
    if family == "qwen3_moe":  # llama.cpp renormalises the top k of every qwen3moe (its expert_weights_norm)
      fields.update(num_experts=int(get("expert_count", required=True)),
                    experts_per_token=int(get("expert_used_count", required=True)),
                    moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
                    norm_topk_prob=bool(get("expert_weights_norm", True)), router_aux_loss_coef=0.001,
                    dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names))
    return fields
  if family != "gemma3":
    return {}
  pattern = get("attention.sliding_window_pattern", 6)  # llama.cpp: a period, or one flag a layer (True: sliding)
  sliding = ([bool(f) for f in pattern] if isinstance(pattern, list) else
             [bool((i + 1) % int(pattern)) for i in range(layers)])
  factor = get("rope.scaling.factor")
  # llama.cpp scales Gemma 3's queries by head_dim ** -0.5, but by (hidden / heads) ** -0.5 in the 27B (62 layers)
  scalar = int(get("embedding_length")) / int(get("attention.head_count")) if layers == 62 else head_dim
  return dict(qk_norm=True, norm_offset=1.0, sandwich_norms=True, embed_scale=True, hidden_act="gelu_tanh",
              query_scale=float(scalar) ** -0.5, sliding_window=int(get("attention.sliding_window", required=True)),
              layer_types=tuple("sliding" if s else "full" for s in sliding), local_rope_theta=10000.0,
              rope_scaling=RopeScaling(factor=float(factor), rope_type="linear")
              if get("rope.scaling.type") == "linear" and factor not in (None, 1.0) else None)


def _tensor_names(reader) -> list[str]:
  return [t.name for t in reader.tensors]


def read_tensors(reader, path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
  """Every tensor the decoder uses, dequantized to float32, under its Hugging Face name and layout."""
  from gguf import quants

  wanted = tensor_names(_field(reader, path, "general.architecture"), config)
  out = {}
  for tensor in reader.tensors:
    targets = wanted.get(tensor.name)
    if targets is None:
      continue
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
      raise GGUFError(f"{path}: tensor {tensor.name!r} has type {kind}, not supported; supported: "
                      f"{list(SUPPORTED_TYPES)}")
    array = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    array = array.reshape([int(n) for n in reversed(tensor.shape)])
    if config.architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
      array = unpermute_rows(array, config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads)
    if config.norm_offset and "norm" in tensor.name:  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
      array = array - config.norm_offset
    for name, expert in targets:
      out[name] = array if expert is None else np.ascontiguousarray(array[expert])
  return out


def read_tokenizer(reader, path: Path) -> tuple[tokenizers.Tokenizer, dict[str, str | None]]:
  """A byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.*`, and its bos/eos/pad token strings."""
  kind = _field(reader, path, "tokenizer.ggml.model", required=True)
  if kind != "gpt2":
    raise GGUFError(f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: ['gpt2'] (byte-level BPE)")
  pre = _field(reader, path, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}")
  tokens = list(_field(reader, path, "tokenizer.ggml.tokens", required=True))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, path, "tokenizer.ggml.merges", required=True)]
  types = list(_field(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens)))
  tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
  splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
  tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
  if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise GGUFError(f"{path}: the tokenizer's special tokens are not in its vocabulary of {len(tokens)}")

  def token(key):
    index = _field(reader, path, f"tokenizer.ggml.{key}")
    if index is not None and not 0 <= int(index) < len(tokens):
      raise GGUFError(f"{path}: tokenizer.ggml.{key}={index} is outside the vocabulary of {len(tokens)}")
    return None if index is None else tokens[int(index)]

  special = dict(bos=token("bos_token_id"), eos=token("eos_token_id"), pad=token("padding_token_id"),
                 add_bos=bool(_field(reader, path, "tokenizer.ggml.add_bos_token", False)),
                 add_eos=bool(_field(reader, path, "tokenizer.ggml.add_eos_token", False)))
  tok.post_processor = special_post_processor(tok, special["bos"], special["eos"], special["add_bos"],
                                              special["add_eos"])
  return tok, special


def read_gguf(path: str | os.PathLike) -> GGUFModel:
  """Reads a GGUF file of a supported family: config, float32 tensors (HF layout), tokenizer, chat template."""
  path = Path(path)
  reader = _open(path)
  config = read_config(reader, path)
  tokenizer, special = read_tokenizer(reader, path)
  if special["eos"] is None:
    raise GGUFError(f"{path}: tokenizer.ggml.eos_token_id is missing")
  tensors = read_tensors(reader, path, config)
  missing = _expected_names(config) - set(tensors)
  if missing:
    raise GGUFError(f"{path}: {len(missing)} tensors are missing (first: {sorted(missing)[0]!r})")
  return GGUFModel(config, tensors, tokenizer, special["bos"], special["eos"], special["pad"],
                   _field(reader, path, "tokenizer.chat_template"), special["add_bos"], special["add_eos"])


def _expected_names(config: ModelConfig) -> set[str]:
  return {spec.hf_name for spec in tensor_layout(config)}


def write_hf_dir(model: GGUFModel, out_dir: str | os.PathLike) -> Path:
  """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with the chat
  template), a directory that `load_hf`/`load_tokenizer` and transformers both load."""
  from safetensors.numpy import save_file

  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in model.tensors.items()}, out / "model.safetensors",
            metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2))
  model.tokenizer.save(str(out / "tokenizer.json"))
  named = {k: v for k, v in dict(bos_token=model.bos_token, eos_token=model.eos_token).items() if v is not None}
  eos, vocab = model.eos_token, model.tokenizer.get_vocab(with_added_tokens=True)
  if model.chat_template:  # an instruct model's turns end with the template's end-of-turn token: stop there too
    eos = end_of_turn_token(model.chat_template, vocab, named) or eos
  settings = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=model.bos_token, eos_token=eos,
                  pad_token=model.pad_token or model.eos_token, add_bos_token=model.add_bos,
                  add_eos_token=model.add_eos, model_max_length=model.config.max_position_embeddings,
                  clean_up_tokenization_spaces=False)
  if model.chat_template:
    settings["chat_template"] = model.chat_template
  stops = list(dict.fromkeys(vocab[t] for t in (eos, model.eos_token)))
  (out / "generation_config.json").write_text(json.dumps(dict(
      bos_token_id=None if model.bos_token is None else vocab[model.bos_token],
      eos_token_id=stops[0] if len(stops) == 1 else stops), indent=2))
  (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
  return out


def convert(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
  """`streamrl convert`: a GGUF file to a Hugging Face directory."""
  return write_hf_dir(read_gguf(gguf_file), out_dir)
