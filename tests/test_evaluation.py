"""The held-out evaluation (`job.evaluation.HeldOut`): each of a run's evaluations after the first reuses the first's
engine (no program traced again), and gives what a fresh engine gives; evaluation at k (avg@k, pass@k) against
hand-worked cases, draws counted one by one, and the rows it wrote."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.job import evaluation
from streamrl_jax.job.config import DemoModelConfig, JobConfig
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
  job = JobConfig(demo=DemoModelConfig(hidden_size=32, num_layers=2), warmup_steps=0, task=TaskConfig(name="arithmetic"))
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


def test_pass_at_k_by_hand_and_by_counting_every_draw():
  from itertools import combinations

  from hypothesis import given, strategies as st

  from streamrl_jax.tasks.heldout import at_k, pass_at_k

  assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
  assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(3, 3, 2) == 1.0 and pass_at_k(8, 1, 8) == 1.0
  with pytest.raises(ValueError, match="0 < k <= n"):
    pass_at_k(2, 1, 3)
  # two prompts, four samples each: one correct of four, and none; a reward of 0.5 is not correct
  assert at_k([[1.0, 0.0, 0.5, 0.0], [0.0, 0.2, 0.0, 0.0]], 4) == {"heldout_avg@4": 0.125, "heldout_pass@4": 0.5}
  assert at_k([[1.0, 0.0, 0.0, 1.0]], 2) == {"heldout_avg@2": 0.5, "heldout_pass@2": pytest.approx(1 - 1 / 6)}

  @given(st.lists(st.booleans(), min_size=1, max_size=7), st.integers(1, 7))
  def matches_counting(correct, k):
    k = min(k, len(correct))
    draws = list(combinations(correct, k))
    assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
  matches_counting()


def test_evaluation_at_k_samples_k_a_prompt_and_scores_what_it_wrote(tmp_path):
  job = JobConfig(demo=DemoModelConfig(hidden_size=32, num_layers=2), warmup_steps=0, eval_prompts=3, eval_k=4,
                  eval_temperature=1.0, eval_top_p=0.9, task=TaskConfig(name="arithmetic"))
  model, tokenizer, _ = job.load_model()
  run = PipelineConfig(max_new_tokens=6)
  held_out = evaluation.held_out_of(job, tokenizer, job.make_task(tokenizer, "eval"), run.sampler, run.max_new_tokens)
  scores = held_out.scores(model, tmp_path / "eval_before.jsonl")
  greedy = [json.loads(line) for line in (tmp_path / "eval_before.jsonl").read_text().splitlines()]
  sampled = [json.loads(line) for line in (tmp_path / "eval_before_at_k.jsonl").read_text().splitlines()]
  assert len(greedy) == 3 and len(sampled) == 3 * 4
  assert [r["prompt"] for r in sampled] == [r["prompt"] for r in greedy for _ in range(4)]  # k a prompt, in order
  assert len({r["completion"] for r in sampled}) > 3  # sampled at a temperature, not greedy four times
  correct = np.array([r["reward"] >= 1.0 for r in sampled]).reshape(3, 4)
  assert scores.at_k == {"heldout_avg@4": pytest.approx(correct.mean()),
                         "heldout_pass@4": pytest.approx(correct.any(axis=1).mean())}
  assert scores.metrics()["heldout_accuracy"] == np.mean([r["reward"] >= 1.0 for r in greedy])
  assert evaluation.held_out_of(dataclasses.replace(job, eval_k=0), tokenizer, held_out.task, run.sampler,
                                6).scores(model) == evaluation.Scores(scores.accuracy)  # greedy alone, the same


def test_evaluation_at_k_settings_are_checked():
  from streamrl_jax.envs.config import EnvConfig

  with pytest.raises(ValueError, match="eval_k must be >= 0"):
    JobConfig(eval_k=-1)
  with pytest.raises(ValueError, match="eval_top_p in"):
    JobConfig(eval_k=4, eval_top_p=0.0)
  agent = dataclasses.replace(PipelineConfig().sampler, env=EnvConfig(agent="my_agent.py:run"))
  with pytest.raises(ValueError, match="evaluation at k of an agent task .* is not built"):
    evaluation.HeldOut(None, None, agent, 8, 4, 0, evaluation.Sampled(4, 1.0, 1.0))
