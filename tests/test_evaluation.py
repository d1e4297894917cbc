"""The held-out evaluation (`job.evaluation.HeldOut`): each of a run's evaluations after the first reuses the first's
engine (no program traced again), and gives what a fresh engine gives."""

import json

import jax
import pytest
from flax import nnx

from streamrl_jax.job import evaluation
from streamrl_jax.job.config import JobConfig
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.tasks.config import TaskConfig

TRACED = "/jax/core/compile/jaxpr_trace_duration"


@pytest.fixture
def traces():
  """The names of the functions jax traces while the test runs."""
  names = []

  def heard(event, duration, **fields):
    if event == TRACED:
      names.append(fields.get("fun_name", "?"))
  jax.monitoring.register_event_duration_secs_listener(heard)
  yield names
  jax.monitoring.unregister_event_duration_listener(heard)


def test_evaluations_after_the_first_trace_nothing_and_match_a_fresh_engine(tmp_path, traces, monkeypatch):
  job = JobConfig(hidden_size=32, num_layers=2, warmup_steps=0, task=TaskConfig(name="arithmetic"))
  model, tokenizer, _ = job.load_model()
  run = PipelineConfig(max_new_tokens=6)
  held_out = evaluation.HeldOut(tokenizer, job.make_task(tokenizer), run.sampler, run.max_new_tokens, 3, seed=5)  # 3 prompts
  assert len(held_out.rows(model)) == 3
  assert traces, "the first evaluation traces its engine's programs"
  graphdef, params = nnx.split(model)
  trained = nnx.merge(graphdef, jax.tree.map(lambda p: p * 1.5, params))  # another policy of the same model
  traces.clear()
  record = tmp_path / "eval_after.jsonl"
  accuracy = held_out.accuracy(trained, record)
  assert traces == []
  rows = [json.loads(line) for line in record.read_text().splitlines()]
  assert len(rows) == 3 and accuracy == sum(r["reward"] >= 1.0 for r in rows) / 3
  monkeypatch.setattr(evaluation, "_engine", evaluation._engine.__wrapped__)  # an engine of its own each time
  assert held_out.rows(trained) == [(r["prompt"], r["completion"], r["reward"]) for r in rows]
