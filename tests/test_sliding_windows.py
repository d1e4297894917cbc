"""Sliding-window layers in both engines: Gemma 3's interleaved windows of 4 decode as transformers does, and a model
whose every layer slides gives the pages its rows leave behind back to the pool, so rows longer than the pool run
without preemption and decode as transformers does."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import load_hf
from streamrl_jax.sampling import EngineConfig, StreamingSampler
from streamrl_jax.sampling.engines import make_engine
from streamrl_jax.types import SamplingParams
from tests.conftest import build_hf_model

PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4, 60, 61, 62, 70, 3, 11], [7, 90, 12]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
LAYOUTS = {"contiguous": EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=24, min_prefill_bucket=16,
                                      short_attention_windows=()),
           "paged": EngineConfig(num_slots=4, max_prompt_length=16, max_new_tokens=24, min_prefill_bucket=16,
                                 kv_layout="paged", page_size=4, short_attention_windows=())}


def greedy(directory, config: EngineConfig):
  model = load_hf(directory)
  graphdef, params = nnx.split(model)
  mesh = mesh_from_devices(jax.devices()[:1], MeshShape(1, 1, 1))
  engine = make_engine(graphdef, model.config, config, mesh)
  sampler = StreamingSampler([engine], params)
  ids = [sampler.submit(p, GREEDY)[0] for p in PROMPTS]
  samples = {s.request_id: s for s in sampler.stream()}
  return [samples[i].completion_tokens for i in ids], engine, sampler


def theirs(hf_model, prompt, n=24):
  with torch.no_grad():
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0)
  return out[0, len(prompt):].numpy()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gemma3_windows_decode_as_transformers_in_both_engines(hf_dirs, layout):
  directory, hf_model = hf_dirs["gemma3"]  # layers: sliding (window 4), global, sliding
  ours, _, _ = greedy(directory, LAYOUTS[layout])
  for got, prompt in zip(ours, PROMPTS):
    np.testing.assert_array_equal(got, theirs(hf_model, prompt), err_msg=f"{layout} {prompt}")


def test_a_model_whose_every_layer_slides_frees_the_pages_its_rows_leave_behind(tmp_path):
  hf_model = build_hf_model("qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=0,
                            layer_types=["sliding_attention"] * 2)
  hf_model.save_pretrained(tmp_path)
  # 4 rows of up to 40 tokens need 40 pages of 4 at full length; the pool holds 14: without freeing, rows would
  # be preempted (or refused)
  tight = EngineConfig(**{**LAYOUTS["paged"].__dict__, "kv_pages": 14})
  ours, engine, sampler = greedy(tmp_path, tight)
  for got, prompt in zip(ours, PROMPTS):
    np.testing.assert_array_equal(got, theirs(hf_model, prompt))
  assert engine.counters.window_freed > 0 and sampler.counters.preempted == 0
