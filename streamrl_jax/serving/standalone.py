"""A standalone server's model: a checkpoint loaded onto one device, its engine and the sampler that runs it."""

from __future__ import annotations

import dataclasses
import logging

from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import load_hf, load_tokenizer
from streamrl_jax.models.catalog import resolve_model
from streamrl_jax.sampling import StreamingSampler, make_engine
from streamrl_jax.sampling.config import EngineConfig
from streamrl_jax.serving.app import ServedModel

_log = logging.getLogger(__name__)


def load_served_model(spec: str, engine_config: EngineConfig, *, dtype: str = "float32", seed: int = 0, name: str = ""):
  """(`ServedModel`, `StreamingSampler`) of `spec` (a catalog name, a .gguf file or a Hugging Face directory) on
  this process's first device, with its weights as version 0."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  path = resolve_model(spec)
  model, tokenizer = load_hf(path, dtype=jnp.dtype(dtype)), load_tokenizer(path)
  if len(tokenizer.stop_ids) > engine_config.max_stop_tokens:
    engine_config = dataclasses.replace(engine_config, max_stop_tokens=len(tokenizer.stop_ids))
  graphdef, params = nnx.split(model)
  engine = make_engine(graphdef, model.config, engine_config, single_device_mesh(jax.devices()[0]))
  sampler = StreamingSampler([engine], params, version=0, seed=seed)
  served = ServedModel(name or spec, tokenizer, engine_config.max_prompt_length, engine_config.max_new_tokens)
  _log.info(f"serving {served.name}: {model.config.param_count():,} parameters, {engine_config.num_slots} slots, "
            f"prompts up to {engine_config.max_prompt_length} tokens, completions up to {engine_config.max_new_tokens}")
  return served, sampler
