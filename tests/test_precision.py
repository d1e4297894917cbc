"""The sampler's weight precision: int8 per-channel quantization against numpy, the wire's bytes, both sides of
the transfer giving the same weights, and the trainer's sampler-vs-trainer mismatch metric."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, Transformer
from streamrl_jax.job.config import JobConfig
from streamrl_jax.models.precision import (SamplerPrecision, channel_axes, decode, encode, landing, to_wire,
                                           wire_bytes)
from streamrl_jax.pytrees import flatten_with_names
from streamrl_jax.streaming import WeightSync
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Trainer
from streamrl_jax.sampling import SamplerConfig
from streamrl_jax.training import TrainerConfig
from streamrl_jax.training.logprobs import token_logprobs
from streamrl_jax.training.call_loss import logprob_mismatch

CONFIG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     qkv_bias=True)


@pytest.fixture(scope="module")
def model_params():
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  return graphdef, params


def test_channel_axes_by_hand():
  assert channel_axes(("vocab", "embed")) == (0,)  # a row per token: lookups and a tied head read rows
  assert channel_axes(("embed", "vocab")) == (1,)  # lm_head: one scale per logit
  assert channel_axes(("embed", "heads", "head_dim")) == (1, 2)  # q/k/v: per output feature
  assert channel_axes(("heads", "head_dim", "embed")) == (2,)  # o_proj contracts heads and head_dim
  assert channel_axes(("mlp", "embed")) == (1,) and channel_axes(("embed", "mlp")) == (1,)
  assert channel_axes(("norm",)) is None and channel_axes(("heads", "head_dim")) is None  # norms, biases


def test_int8_weights_dequantize_within_half_a_step_of_numpy_scales(model_params):
  _, params = model_params
  wire = encode(params, "int8")
  out = decode(wire)
  originals, decoded = flatten_with_names(params), flatten_with_names(out)
  metadata = {jax.tree_util.keystr(p): v.get_metadata()["logical_axes"]
              for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
  quantized = 0
  for name, original in originals.items():
    variable_name = name.removesuffix(".value")
    axes = channel_axes(metadata[variable_name])
    w, got = np.asarray(original), np.asarray(decoded[name])
    if axes is None:  # norms and biases travel as float32, untouched
      np.testing.assert_array_equal(got, w)
      continue
    quantized += 1
    reduce = tuple(i for i in range(w.ndim) if i not in axes)
    scale = np.abs(w).max(axis=reduce, keepdims=True) / 127.5  # symmetric int8, the top bucket used whole
    np.testing.assert_allclose(np.asarray(wire["scales"][variable_name]), scale, rtol=1e-6)
    assert np.all(np.abs(got - w) <= scale / 2 * (1 + 1e-4)), name  # float rounding at the bucket edges
    q = np.asarray(flatten_with_names(wire["values"])[name])
    assert q.dtype == np.int8 and q.shape == w.shape
    np.testing.assert_allclose(got, q.astype(np.float32) * scale, rtol=1e-6)
  assert quantized == 2 + 7 * CONFIG.num_layers  # embed, lm_head; q, k, v, o, gate, up, down per layer


def test_wire_bytes_of_each_precision(model_params):
  _, params = model_params
  f32 = wire_bytes(encode(params, "float32"))
  n = sum(int(a.size) for a in jax.tree.leaves(params))
  assert f32 == 4 * n and wire_bytes(encode(params, "bfloat16")) == 2 * n
  int8 = wire_bytes(encode(params, "int8"))
  assert int8 < 0.45 * f32  # a tiny model: norms, biases and per-channel scales weigh more than in a real one


def test_quantizing_on_either_side_gives_the_sampler_the_same_weights(model_params):
  """int8 reduced on the trainer (int8 moves) or on the sampler (float32 moves) lands as the same weights,
  sharded on the sampler's mesh; float32 lands as the trainer's weights."""
  _, params = model_params
  mesh = mesh_from_devices(jax.devices()[:2], MeshShape(2, 1, 1))
  landed = {}
  for side in ("trainer", "sampler"):
    precision = SamplerPrecision("int8", side)
    sync = WeightSync(landing(params, precision, mesh), precision)
    sync.publish(params, version=0)
    landed[side] = sync.wait_for(0, timeout=60).params
  sent = {side: wire_bytes(to_wire(params, SamplerPrecision("int8", side))) for side in ("trainer", "sampler")}
  assert sent["trainer"] < 0.45 * sent["sampler"]
  expected = decode(encode(params, "int8"))
  for side, got in landed.items():
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, err_msg=side)
    leaf = got["layers"][0]["mlp"]["up_proj"][...]
    assert leaf.dtype == jnp.float32 and set(leaf.sharding.device_set) == set(jax.devices()[:2])
  assert to_wire(params, SamplerPrecision())["values"] is params  # float32: the arrays themselves, no copy
  with pytest.raises(ValueError, match="sampler precision 'fp4'"):
    SamplerPrecision("fp4")


def test_mismatch_metric_matches_numpy():
  rng = np.random.default_rng(0)
  logp, mu = rng.normal(-2, 0.5, (3, 6)), rng.normal(-2, 0.5, (3, 6))
  mask = rng.random((3, 6)) < 0.6
  total, largest = logprob_mismatch(jnp.asarray(logp), jnp.asarray(mu), jnp.asarray(mask))
  d = (logp - mu)[mask]
  np.testing.assert_allclose(float(total), np.sum(np.exp(d) - 1 - d), rtol=1e-5)
  np.testing.assert_allclose(float(largest), np.abs(d).max(), rtol=1e-6)


def test_the_trainer_reports_no_mismatch_for_its_own_logprobs_and_some_for_others(model_params):
  """The step's `logprob_mismatch_kl` is ~0 when the sampler's log-probabilities are the trainer's own of the
  same tokens, and clearly not when they belong to the neighbouring tokens (a misaligned ratio) or to int8
  weights."""
  graphdef, params = model_params
  mesh = mesh_from_devices(jax.devices()[:2], MeshShape(2, 1, 1))
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=1e-3), ObjectiveConfig(), mesh)
  rng = np.random.default_rng(1)
  tokens = rng.integers(3, CONFIG.vocab_size, (8, 16)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  loss_mask = valid.copy()
  loss_mask[:, :6] = False  # a prompt of 6 tokens

  def logprobs_under(weights):
    model = nnx.merge(graphdef, weights)
    return np.asarray(token_logprobs(model(jnp.asarray(tokens), jnp.asarray(valid)), jnp.asarray(tokens))[0])

  own = logprobs_under(params)
  quantized = logprobs_under(decode(encode(params, "int8")))
  metrics = {}
  for name, mu in (("own", own), ("shifted", np.roll(own, 1, axis=1)), ("int8", quantized)):
    state = trainer.init_state(params)
    batch = dict(tokens=tokens, valid=valid, loss_mask=loss_mask, advantages=rng.normal(size=(8,)).astype(np.float32),
                 logprobs=np.where(loss_mask, mu, 0.0).astype(np.float32))
    _, metrics[name] = trainer.apply(trainer.accumulate(state, batch))
  assert metrics["own"]["logprob_mismatch_kl"] < 1e-7 and metrics["own"]["logprob_mismatch_max"] < 1e-4
  assert metrics["shifted"]["logprob_mismatch_kl"] > 1e-3
  assert 1e-7 < metrics["int8"]["logprob_mismatch_kl"] < metrics["shifted"]["logprob_mismatch_kl"]
  d = (own - quantized)[loss_mask]  # the trainer's log-probabilities against the int8 sampler's, by numpy
  np.testing.assert_allclose(metrics["int8"]["logprob_mismatch_kl"], np.mean(np.exp(d) - 1 - d), rtol=0.05)


def test_preflight_tells_of_an_uncorrected_low_precision_sampler_or_async_run():
  from streamrl_jax.pipeline import PipelineConfig
  from streamrl_jax.pipeline.preflight import correction_advice
  from streamrl_jax.training import ObjectiveConfig as Objective
  def config(precision, correction, mode="stream"):
    return PipelineConfig(mode=mode, sampler=SamplerConfig(precision=precision),
                          trainer=TrainerConfig(objective=Objective(correction=correction)))
  assert correction_advice(config("int8", "token_tis")) is None
  assert correction_advice(config("float32", "none")) is None  # on-policy and float32: nothing to correct
  advice = correction_advice(config("bfloat16", "none"))
  assert "SamplerConfig.precision='bfloat16'" in advice and "'token_tis'" in advice and "\n" not in advice
  advice = correction_advice(config("float32", "none", "async"))
  assert advice.startswith("PipelineConfig.mode='async' (staleness 1): tokens another policy sampled")
  assert correction_advice(config("float32", "veto", "async")) is None
  with pytest.raises(ValueError, match="quantize_on='gpu'"):
    PipelineConfig(sampler=SamplerConfig(quantize_on="gpu"))


def test_an_unknown_compute_dtype_is_refused_by_its_key():
  with pytest.raises(ValueError, match=r"JobConfig.compute_dtype='float16'; known: \['auto', 'float32', 'bfloat16'\]"):
    JobConfig(compute_dtype="float16")


def test_a_bfloat16_job_keeps_float32_weights_and_float32_logits():
  """bfloat16 activations and matmuls, float32 master weights, and the head accumulated in float32: its logits equal
  float32 arithmetic on the bfloat16 operands (rounding them to bfloat16 would be off by ~1e-3 relative)."""
  model, tokenizer, _ = JobConfig(compute_dtype="bfloat16", warmup_steps=0).load_model()
  assert model.config.compute_dtype == jnp.bfloat16
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}
  hidden = jax.random.normal(jax.random.key(0), (3, 5, model.config.hidden_size), jnp.bfloat16)
  logits = model.head_logits(hidden)
  weights = np.asarray(model.head_weights().astype(jnp.bfloat16), np.float32)
  expected = np.asarray(hidden, np.float32) @ weights
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)
  tokens = jnp.asarray([tokenizer.encode("12+34=")])
  assert model(tokens).dtype == jnp.float32
