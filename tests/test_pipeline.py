"""The four run modes end to end on a tiny model: accounting, staleness, on-policy equivalence."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.models import Transformer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.sampling import EngineConfig
from streamrl_jax.sampling import SamplerConfig
from streamrl_jax.pipeline.run_hooks import RunHooks
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask, run


@pytest.fixture(scope="module")
def results():
  return {mode: run(mode) for mode in ("colocated", "disaggregated", "stream", "async")}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "stream", "async"])
def test_every_prompt_is_generated_and_trained_once(results, mode):
  result = results[mode]
  counters = result.counters
  assert counters["prompts_submitted"] == 3 * 4
  assert counters["samples_generated"] == counters["samples_trained"] == 3 * 16 == counters["queue_got_samples"]
  assert counters["stale_samples"] == 0
  assert [m["step"] for m in result.metrics] == [1, 2, 3]
  for m in result.metrics:
    assert 0 <= m["reward_mean"] <= 1 and m["tokens"] > 0 and m["grad_norm"] > 0
    for key in ("samples_per_s", "staleness_mean", "trainer_idle_frac", "sampler_idle_frac", "weight_sync_s"):
      assert key in m


def test_on_policy_modes_never_use_stale_weights(results):
  for mode in ("colocated", "disaggregated", "stream"):
    assert all(m["staleness_max"] == 0 for m in results[mode].metrics), mode


def test_async_staleness_is_bounded_and_used(results):
  staleness = [m["staleness_max"] for m in results["async"].metrics]
  assert max(staleness) <= BASE.staleness and max(staleness) == 1  # it does run ahead


def test_stream_ends_with_the_parameters_of_disaggregated(results):
  a, b = results["stream"].params, results["disaggregated"].params
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
  moved = max(float(np.abs(x - y).max()) for x, y in
              zip(jax.tree.leaves(a), jax.tree.leaves(nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))[1])))
  assert moved > 1e-5  # training changed the weights


def test_a_donated_model_is_freed_once_the_trainer_holds_its_copy_and_trains_the_same(results):
  model = Transformer(MODEL, rngs=nnx.Rngs(0))
  donated = run_pipeline(dataclasses.replace(BASE, mode="colocated"), model, TOKENIZER, DigitTask(max_digits=3),
                         hooks=RunHooks(donate_model=True))
  assert all(x.is_deleted() for x in jax.tree.leaves(nnx.state(model)))  # no dead copy for the rest of the run
  for x, y in zip(jax.tree.leaves(donated.params), jax.tree.leaves(results["colocated"].params)):
    np.testing.assert_array_equal(x, y)
  kept = Transformer(MODEL, rngs=nnx.Rngs(0))
  run_pipeline(dataclasses.replace(BASE, mode="colocated", steps=1), kept, TOKENIZER, DigitTask(max_digits=3))
  assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(kept)))  # not donated: the caller's


def test_bad_pipeline_configs():
  with pytest.raises(ValueError, match="mode='pipelined'"):
    PipelineConfig(mode="pipelined")
  with pytest.raises(ValueError, match="group_size >= 2"):
    PipelineConfig(group_size=1)
  with pytest.raises(ValueError, match="EngineConfig.max_new_tokens=32 differs from PipelineConfig.max_new_tokens=48"):
    PipelineConfig(max_new_tokens=48, sampler=SamplerConfig(engine=EngineConfig(max_new_tokens=32)))
  assert PipelineConfig(max_new_tokens=24).sampler.engine.max_new_tokens == 24  # derived once, from the run's


def test_resume_after_a_stop_continues_the_data_stream_exactly(results, tmp_path):
  from streamrl_jax.training.checkpoint import Checkpointer
  model = Transformer(MODEL, rngs=nnx.Rngs(0))
  first = dataclasses.replace(BASE, mode="stream", steps=2)  # stopped after step 2 of 3
  checkpointer = Checkpointer(tmp_path, max_to_keep=2)
  run_pipeline(first, model, TOKENIZER, DigitTask(max_digits=3), hooks=RunHooks(checkpointer))
  assert checkpointer.steps == [1, 2]
  resumed = run_pipeline(dataclasses.replace(BASE, mode="stream"), model, TOKENIZER, DigitTask(max_digits=3),
                         hooks=RunHooks(checkpointer, resume=True))
  assert resumed.counters["prompts_submitted"] == 4 and [m["step"] for m in resumed.metrics] == [3]
  for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(results["stream"].params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    run_pipeline(BASE, model, TOKENIZER, DigitTask(max_digits=3),
                 hooks=RunHooks(Checkpointer(tmp_path / "empty"), resume=True))


def test_skew_aware_scheduling_with_instances_changing_mid_run(results, tmp_path, monkeypatch):
  """Ranker-driven dispatch over engine instances that join and leave while the job runs: every prompt is trained
  once, the parameters equal the FIFO single-instance run (samples depend on (seed, group, index) only),
  the ranker's metrics are logged and its state is checkpointed and restored."""
  from streamrl_jax.scheduling import SchedulingConfig
  from streamrl_jax.training.checkpoint import Checkpointer
  targets = iter([2, 1, 2, 2])
  monkeypatch.setattr(SchedulingConfig, "instance_target", lambda self, current, gen_s, train_s: next(targets))
  scheduling = SchedulingConfig(policy="skew_aware", instances=1, max_instances=2, elastic=True)
  checkpointer = Checkpointer(tmp_path, max_to_keep=3)
  config = dataclasses.replace(BASE, mode="stream", scheduling=scheduling)
  first = run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, DigitTask(max_digits=3),
                       hooks=RunHooks(checkpointer))
  assert [m["sampler_instances"] for m in first.metrics] == [1, 2, 1]
  assert first.counters["samples_trained"] == 3 * 16 and first.counters["prompts_submitted"] == 3 * 4
  for m in first.metrics:
    assert {"ranker_recall_top20", "ranker_recall_top10", "ranker_recall_top5", "ranker_spearman"} <= set(m)
    assert m["generation_s"] > 0 and 0 <= m["ranker_recall_top20"] <= 1 and -1 <= m["ranker_spearman"] <= 1
  for x, y in zip(jax.tree.leaves(first.params), jax.tree.leaves(results["stream"].params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
  resumed = run_pipeline(dataclasses.replace(config, steps=4), Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER,
                         DigitTask(max_digits=3), hooks=RunHooks(checkpointer, resume=True))
  assert [m["step"] for m in resumed.metrics] == [4]
  from streamrl_jax.scheduling import OnlineRanker
  saved = checkpointer.restore_aux({"ranker": OnlineRanker(scheduling.ranker).state_arrays()})
  assert int(saved["ranker"]["count"]) == 4 * 4  # 12 prompts restored from step 3's checkpoint, 4 more


def test_the_paged_engine_runs_the_pipeline_to_the_contiguous_engines_weights(results):
  """stream-mode GRPO (on-policy: no timing in what is sampled) with the sampler on the paged engine: every
  prompt trained once, and the same samples (the same keys, the same logits up to float noise) give the
  contiguous run's parameters."""
  engine = dataclasses.replace(BASE.sampler.engine, kv_layout="paged", page_size=4)
  paged = run("stream", sampler=dataclasses.replace(BASE.sampler, engine=engine))
  assert paged.counters["samples_generated"] == paged.counters["samples_trained"] == 3 * 16
  for x, y in zip(jax.tree.leaves(paged.params), jax.tree.leaves(results["stream"].params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_an_int8_sampler_is_measured_against_the_float32_trainer(results):
  """On-policy (stream) with the sampler's weights int8 (quantized on its own side, float32 moves): every
  prompt trained once, and the step's sampler-vs-trainer mismatch is well above the float32 run's, which is
  float noise only (the same weights and tokens on both sides)."""
  int8 = run("stream", sampler=dataclasses.replace(BASE.sampler, precision="int8", quantize_on="sampler"))
  assert int8.counters["samples_generated"] == int8.counters["samples_trained"] == 3 * 16
  same = [m["logprob_mismatch_kl"] for m in results["stream"].metrics]
  low = [m["logprob_mismatch_kl"] for m in int8.metrics]
  assert max(same) < 1e-6 and all(m["logprob_mismatch_max"] < 1e-3 for m in results["stream"].metrics), same
  assert min(low) > 10 * max(same) and all(m["logprob_mismatch_max"] > 1e-3 for m in int8.metrics), low


def test_the_trainer_scores_tokens_at_the_samplers_temperature(results):
  """Sampled at temperature 0.6, on-policy: the trainer divides its logits by the same temperature, so its
  log-probabilities of the sampled tokens are the sampler's (mismatch float noise only, as at temperature 1);
  scoring them untempered would put a gap of the temperature's size between the two."""
  cold = run("stream", temperature=0.6)
  assert cold.counters["samples_trained"] == 3 * 16
  assert all(m["logprob_mismatch_kl"] < 1e-6 and m["logprob_mismatch_max"] < 1e-3 for m in cold.metrics), cold.metrics
  with pytest.raises(ValueError, match="PipelineConfig.temperature must be > 0"):
    dataclasses.replace(BASE, temperature=0.0)
