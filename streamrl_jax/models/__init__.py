"""Llama/Qwen2 decoders in Flax NNX, their KV cache, Hugging Face checkpoints and tokenizers."""

from streamrl_jax.models.config import ModelConfig, RopeScaling
from streamrl_jax.models.generate import generate, pad_prompts
from streamrl_jax.models.hf_io import load_hf, read_hf_config, save_hf
from streamrl_jax.models.kv_cache import KVCache, kv_cache_bytes
from streamrl_jax.models.sharding import DEFAULT_RULES, logical_spec, shard_model, state_shardings
from streamrl_jax.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from streamrl_jax.models.transformer import Transformer, ValueModel, abstract_model

__all__ = [
    "CharTokenizer", "DEFAULT_RULES", "HFTokenizer", "KVCache", "ModelConfig", "RopeScaling",
    "Tokenizer", "Transformer", "ValueModel", "abstract_model", "generate", "kv_cache_bytes", "load_hf", "load_tokenizer",
    "logical_spec", "pad_prompts", "read_hf_config", "save_hf", "shard_model", "state_shardings",
]
