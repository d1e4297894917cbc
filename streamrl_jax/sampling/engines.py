"""Engines by KV layout (`EngineConfig.kv_layout`): the contiguous cache per slot, or the page pool."""

from __future__ import annotations

from jax.sharding import Mesh

from streamrl_jax.models import ModelConfig
from streamrl_jax.sampling.engine import KV_LAYOUTS, DecodeEngine, EngineConfig
from streamrl_jax.sampling.paged_engine import PagedDecodeEngine

ENGINES = {"contiguous": DecodeEngine, "paged": PagedDecodeEngine}
assert tuple(ENGINES) == KV_LAYOUTS


def make_engine(graphdef, model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules=None):
  """The engine of `config.kv_layout` for a model on `mesh`."""
  return ENGINES[config.kv_layout](graphdef, model_config, config, mesh, rules)


def kv_tokens(engine) -> int:
  """Tokens of keys and values the engine can hold at once: its pages, or its slots at full length."""
  if isinstance(engine, PagedDecodeEngine):
    return engine.num_pages * engine.page_size
  return engine.config.num_slots * engine.config.cache_length
