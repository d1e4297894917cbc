"""compute_dtype='auto' decided by measurement (models/dtype_probe.py): the choice from the probe's figures, the
cache per machine, accelerators and forced answers without a probe, and a sampler's 'auto' weights following it."""

import json
import math

import pytest

from streamrl_jax.arms.config import ArmsConfig
from streamrl_jax.models import dtype_probe
from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.dtype_probe import PROBE_ENV, ProductShapes, choose_compute_dtype
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.job.config import JobConfig
from streamrl_jax.sampling.config import SamplerConfig

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3)
TINY = ProductShapes(rows=8, layer=((16, 32), (32, 16)), layers=2, head=(16, 64))  # measured for real: cheap
PROBED = ProductShapes(rows=256, layer=((512, 1024), (1024, 512)), layers=4, head=(512, 4096))  # over 1 GFLOP


@pytest.fixture
def probe(monkeypatch, tmp_path):
  """The probe unforced, its cache in tmp_path, its measurement faked: set `figures` to (float32, bfloat16) FLOP/s;
  `calls` counts measurements."""
  monkeypatch.delenv(PROBE_ENV, raising=False)
  dtype_probe._probed.cache_clear()
  state = {"figures": (1e11, 1e11), "calls": 0}

  def measure(shapes):
    state["calls"] += 1
    return state["figures"]
  monkeypatch.setattr(dtype_probe, "measure", measure)
  yield state, tmp_path
  dtype_probe._probed.cache_clear()


def test_a_models_product_shapes_are_its_layers_and_head():
  shapes = ProductShapes.of(SMOLLM2)
  # q (9 heads of 64) with k and v (3 heads each), o, gate and up together, down; the head over the vocabulary
  assert shapes.layer == ((576, 576 + 2 * 192), (576, 576), (576, 2 * 1536), (1536, 576)) and shapes.layers == 30
  assert shapes.head == (576, 49152)
  per_layer = 576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576
  assert shapes.flops() == 3 * 2 * 256 * (30 * per_layer + 576 * 49152)


@pytest.mark.parametrize("figures, expected", [((1e11, 4e11), "bfloat16"), ((3e11, 2.5e11), "float32"),
                                               ((1e11, 1.04e11), "float32"), ((1e11, 1.1e11), "bfloat16")])
def test_auto_on_a_cpu_is_the_faster_dtype_and_float32_on_a_tie(probe, figures, expected):
  state, cache = probe
  state["figures"] = figures
  choice = choose_compute_dtype("auto", PROBED, backend="cpu", cache_dir=cache)
  assert choice.dtype == expected and (choice.float32_flops, choice.bfloat16_flops) == figures
  assert choice.flops() == figures[expected == "bfloat16"]
  assert f"'auto' on this CPU: {expected}" in choice.reason and "measured now" in choice.reason


def test_the_probe_runs_once_per_machine_and_shape(probe):
  state, cache = probe
  state["figures"] = (1e11, 3e11)
  assert choose_compute_dtype("auto", PROBED, backend="cpu", cache_dir=cache).dtype == "bfloat16"
  dtype_probe._probed.cache_clear()  # a new process: the cache file answers
  again = choose_compute_dtype("auto", PROBED, backend="cpu", cache_dir=cache)
  assert again.dtype == "bfloat16" and "cached" in again.reason and state["calls"] == 1
  other = ProductShapes.of(SMOLLM2)
  choose_compute_dtype("auto", other, backend="cpu", cache_dir=cache)
  assert state["calls"] == 2  # another model's shapes are measured for themselves
  entries = json.loads((cache / dtype_probe.CACHE_FILE).read_text())
  assert len(entries) == 2 and all(dtype_probe.machine() in key and "jax " in key for key in entries)


def test_a_torn_cache_file_is_measured_again(probe):
  state, cache = probe
  (cache / dtype_probe.CACHE_FILE).write_text('{"half a')
  assert choose_compute_dtype("auto", PROBED, backend="cpu", cache_dir=cache).dtype == "float32"
  assert state["calls"] == 1 and json.loads((cache / dtype_probe.CACHE_FILE).read_text())


@pytest.mark.parametrize("backend", ["gpu", "cuda", "rocm", "tpu"])
def test_accelerators_keep_bfloat16_without_a_probe(probe, backend):
  state, cache = probe
  assert choose_compute_dtype("auto", PROBED, backend=backend, cache_dir=cache).dtype == "bfloat16"
  assert state["calls"] == 0


def test_a_named_dtype_is_kept_and_a_forced_answer_skips_the_probe(probe, monkeypatch):
  state, cache = probe
  assert choose_compute_dtype("bfloat16", None, backend="cpu").reason == "named by the config"
  assert choose_compute_dtype("float32", None, backend="tpu").dtype == "float32"
  monkeypatch.setenv(PROBE_ENV, "bfloat16")
  forced = choose_compute_dtype("auto", PROBED, backend="cpu", cache_dir=cache)
  assert forced.dtype == "bfloat16" and PROBE_ENV in forced.reason and state["calls"] == 0
  monkeypatch.setenv(PROBE_ENV, "float16")
  with pytest.raises(ValueError, match=rf"{PROBE_ENV}='float16'; known: \['float32', 'bfloat16'\]"):
    choose_compute_dtype("auto", PROBED, backend="cpu", cache_dir=cache)


def test_a_model_too_small_for_its_dtype_to_matter_computes_in_float32_unprobed(probe):
  state, cache = probe
  state["figures"] = (1e11, 9e11)
  choice = choose_compute_dtype("auto", TINY, backend="cpu", cache_dir=cache)
  assert choice.dtype == "float32" and "too small" in choice.reason and state["calls"] == 0


def test_the_probe_measures_both_dtypes_on_this_machine():
  f32, bf16 = dtype_probe.measure(TINY, repeats=1)
  assert all(math.isfinite(f) and f > 0 for f in (f32, bf16))


@pytest.mark.parametrize("forced", ["float32", "bfloat16"])
def test_a_job_computes_in_the_probes_choice_and_its_samplers_weights_follow(monkeypatch, forced):
  monkeypatch.setenv(PROBE_ENV, forced)
  job = JobConfig(warmup_steps=0)
  assert job.dtype() == forced and job.model_spec()[0].dtype == forced
  config = PipelineConfig()
  assert config.sampler.precision == "auto"
  with pytest.raises(ValueError, match=r"SamplerConfig.precision='auto'.*PipelineConfig.resolved"):
    config.precision  # noqa: B018
  assert config.resolved(job.dtype()).precision.precision == forced
  named = PipelineConfig(sampler=SamplerConfig(precision="int8"))
  assert named.resolved(forced).sampler.precision == "int8"  # a named precision is a user's choice


def test_follower_programs_get_float32_weights_whatever_auto_means():
  config = PipelineConfig(mode="async", arms=ArmsConfig(programs=True))
  assert config.resolved("bfloat16").sampler.precision == "float32"


def test_no_shipped_config_names_a_compute_dtype_or_a_float_sampler_precision():
  """The shipped configs leave both to the machine ('auto'); int8 stays a choice a config may make."""
  from streamrl_jax.gin_config import CONFIG_DIRS

  named = [f"{path.name}:{n}" for d in CONFIG_DIRS if d.is_dir() for path in sorted(d.rglob("*.gin"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if not line.lstrip().startswith("#") and ("JobConfig.compute_dtype" in line or (
               "SamplerConfig.precision" in line and "int8" not in line))]
  assert not named, f"configs naming a dtype by hand: {named}"
