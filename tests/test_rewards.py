"""Rewards: built-in verifiers by hand, functions by import path, every bad input named, workers equal to the
sampler's thread, and the pipeline's reward/<name> metrics against a recomputation from the samples trained."""

import dataclasses
import re
import textwrap

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.rewards import (RewardConfig, RewardError, RewardFunctionError, RewardScorer, check_signature,
                                  checked_value, exact_match, load_function, make_regex_reward, math_equivalence,
                                  numeric_answer, regex_format)

REWARDS = '''
import math, os, time

def unit(prompt, completion, answer, unit, **fields):
  return float(completion.strip().endswith(unit))

def echo_fields(prompt, completion, **fields):
  return float(fields["weight"]) * (prompt == "How heavy?")

def boom(prompt, completion, **fields):
  raise KeyError("no such thing")

def nan(prompt, completion, **fields):
  return math.nan

def inf(prompt, completion, **fields):
  return -math.inf

def text(prompt, completion, **fields):
  return "1.0"

def nothing(prompt, completion, **fields):
  return None

def hang(prompt, completion, **fields):
  if completion == "hang":
    time.sleep(60)
  return 0.5

def die(prompt, completion, **fields):
  os._exit(7)

def two_args(prompt, completion):
  return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture(scope="module")
def module_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
  path.write_text(REWARDS)
  return path


# ---- built-in verifiers, by hand ------------------------------------------------------------------
def test_numeric_answer_by_hand():
  assert numeric_answer("", "so the answer is 72", "Natalia sold 48 + 24 = 72 clips.\n#### 72") == 1.0
  assert numeric_answer("", "It costs 1200.", "#### 1,200") == 1.0
  assert numeric_answer("", "72 or maybe 73", 72) == 0.0
  assert numeric_answer("", "0.5", "1/2 is #### 0.5") == 1.0 and numeric_answer("", "no number", "3") == 0.0
  with pytest.raises(ValueError, match="holds no number"):
    numeric_answer("", "1", "none")


def test_exact_match_by_hand():
  assert exact_match("", "  Paris. ", "paris") == 1.0
  assert exact_match("", "\"Blue whale\"", "blue   whale") == 1.0
  assert exact_match("", "Lyon", ["Paris", "Lyon"]) == 1.0
  assert exact_match("", "Paris, France", "Paris") == 0.0


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="abcdefgh XYZ", min_size=1, max_size=12).filter(lambda s: s.strip()))
def test_exact_match_ignores_case_and_space(answer):
  assert exact_match("", f"  {answer.upper()}  ", answer.lower()) == 1.0


@settings(max_examples=40, deadline=None)
@given(st.integers(-10**9, 10**9), st.integers(-10**9, 10**9))
@example(999_999, 1_000_000)  # within a relative 1e-6 of each other: once counted equal
def test_numeric_answer_is_exact_on_integers(a, b):
  assert numeric_answer("", f"The result: {a:,}", f"#### {b}") == float(a == b)


def test_regex_format_by_hand():
  assert regex_format("", "so \\boxed{12}") == 1.0 and regex_format("", "12") == 0.0
  assert regex_format("", "Answer: 3 kg", format_regex=r"Answer: \d+ \w+") == 1.0
  answer_line = make_regex_reward(r"(?s).*Answer: -?\d+", name="answer_line")
  assert answer_line.__name__ == "answer_line"
  assert answer_line("", "working...\nAnswer: 42") == 1.0 and answer_line("", "Answer: 42 kg") == 0.0


def test_math_equivalence_by_hand():
  assert math_equivalence("", "so the answer is \\boxed{\\frac{3}{4}}", "0.75") == 1.0
  assert math_equivalence("", "\\boxed{\\frac{6}{8}}", "\\frac{3}{4}") == 1.0
  assert math_equivalence("", "The answer is $x = 2$", "2") == 1.0
  assert math_equivalence("", "\\boxed{8}", "7") == 0.0
  assert math_equivalence("", "I do not know", "7") == 0.0


def test_values_are_checked():
  assert checked_value(True) == (1.0, "") and checked_value(np.float32(0.25)) == (0.25, "")
  assert checked_value(np.array(2)) == (2.0, "")
  for bad, said in ((float("nan"), "returned nan"), (float("inf"), "returned inf"), ("1.0", "a str"),
                    (None, "a NoneType"), ([1.0], "a list")):
    value, problem = checked_value(bad)
    assert value is None and said in problem


# ---- functions by path --------------------------------------------------------------------------
def test_both_import_path_forms(module_file):
  assert load_function("streamrl_jax.rewards.verifiers:exact_match") is exact_match
  unit = load_function(f"{module_file}:unit")
  assert unit("", "3 kg", answer="3", unit="kg") == 1.0
  config = RewardConfig(functions=(f"{module_file}:unit", "streamrl_jax.rewards.verifiers:exact_match",
                                   "streamrl_jax.tasks.arithmetic:arithmetic_reward"))
  assert config.names == ("unit", "exact_match", "arithmetic_reward") and config.function_weights == (1.0, 1.0, 1.0)
  clash = RewardConfig(functions=(f"{module_file}:unit", "other.module:unit"))
  assert clash.names == ("my_rewards.unit", "module.unit")


@pytest.mark.parametrize("spec, said", [
    ("{dir}/missing.py:unit", "missing.py not found"),
    ("no_such_package.rewards:unit", "module 'no_such_package' not found"),
    ("{file}:absent", "has no 'absent'"),
    ("{file}:NOT_A_FUNCTION", "is a int, not a function"),
])
def test_a_function_that_cannot_be_loaded_is_named(module_file, spec, said):
  spec = spec.format(dir=module_file.parent, file=module_file)
  with pytest.raises(RewardFunctionError, match=said) as err:
    load_function(spec)
  assert spec in str(err.value)


def test_a_module_that_raises_on_import_is_named(tmp_path):
  path = tmp_path / "broken.py"
  path.write_text("raise RuntimeError('needs a GPU')\n")
  with pytest.raises(RewardFunctionError, match=r"broken.py:f.*raised RuntimeError: needs a GPU"):
    load_function(f"{path}:f")


def test_wrong_signatures_and_configs_are_refused(module_file):
  check_signature(f"{module_file}:unit", "q", {"answer": "3", "unit": "kg"})
  with pytest.raises(RewardFunctionError, match=r"two_args.*fields \['answer'\].*add \*\*fields"):
    check_signature(f"{module_file}:two_args", "q", {"answer": "3"})
  with pytest.raises(RewardFunctionError, match=r"unit.*missing a required argument: 'unit'"):
    check_signature(f"{module_file}:unit", "q", {"answer": "3"})
  with pytest.raises(ValueError, match="weights has 1 entries for 2 functions"):
    RewardConfig(functions=("a.b:c", "a.b:d"), weights=(1.0,))
  with pytest.raises(ValueError, match="is not 'package.module:function'"):
    RewardConfig(functions=("a.b.c",))
  with pytest.raises(ValueError, match="on_error='skip'"):
    RewardConfig(on_error="skip")


# ---- the scorer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_fields_reach_the_functions_and_totals_are_weighted(module_file, workers):
  config = RewardConfig(functions=(f"{module_file}:unit", f"{module_file}:echo_fields"), weights=(1.0, 0.5),
                        workers=workers)
  with RewardScorer(config) as scorer:
    rows = [("How heavy?", "3 kg", {"answer": "3", "unit": "kg", "weight": 2}),
            ("How heavy?", "3 g", {"answer": "3", "unit": "kg", "weight": 4}),
            ("How long?", "5 m", {"answer": "5", "unit": "m", "weight": 8})]
    for i, (prompt, completion, fields) in enumerate(rows):
      scorer.submit(i, prompt, completion, fields, f"row {i}")
    got = {}
    while scorer.pending:
      scorer.wait(1.0)
      got.update(scorer.done())
  assert [got[i].parts for i in range(3)] == [(1.0, 2.0), (0.0, 4.0), (1.0, 0.0)]
  assert [got[i].total for i in range(3)] == [2.0, 2.0, 1.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_file_imports_the_module_beside_it(tmp_path, workers):
  folder = tmp_path / "own"
  folder.mkdir()
  (folder / "helpers_beside.py").write_text("def last_word(text):\n  return text.split()[-1]\n")
  (folder / "scored.py").write_text("import helpers_beside\n\n"
                                    "def says(prompt, completion, answer, **fields):\n"
                                    "  return float(helpers_beside.last_word(completion) == answer)\n")
  with RewardScorer(RewardConfig(functions=(f"{folder}/scored.py:says",), workers=workers)) as scorer:
    assert scorer.score("q", "it is blue", {"answer": "blue"}, "row 1").total == 1.0
    assert scorer.score("q", "it is red", {"answer": "blue"}, "row 2").total == 0.0


@pytest.mark.parametrize("function, said", [
    ("boom", "raised KeyError: 'no such thing'"), ("nan", "returned nan"), ("inf", "returned -inf"),
    ("text", "returned a str"), ("nothing", "returned a NoneType")])
def test_a_bad_reward_stops_naming_function_row_and_problem(module_file, function, said):
  with RewardScorer(RewardConfig(functions=(f"{module_file}:{function}",), workers=1)) as scorer:
    with pytest.raises(RewardError, match=f"reward function '{function}' {said}.* on data.jsonl, row 3, step 1"):
      scorer.score("q", "c", {}, "data.jsonl, row 3, step 1")


def test_bad_rewards_score_zero_and_are_counted_with_on_error_zero(module_file):
  functions = tuple(f"{module_file}:{name}" for name in ("boom", "nan", "text", "unit"))
  scorer = RewardScorer(RewardConfig(functions=functions, workers=0, on_error="zero"))
  score = scorer.score("q", "3 kg", {"answer": "3", "unit": "kg"}, "row 1")
  assert score.parts == (0.0, 0.0, 0.0, 1.0) and score.total == 1.0 and (score.errors, score.timeouts) == (3, 0)
  assert scorer.counters["reward_errors"] == 3


def test_a_hung_reward_times_out_its_worker_is_replaced(module_file):
  hang = RewardConfig(functions=(f"{module_file}:hang",), workers=1, timeout_s=0.5, on_error="zero")
  with RewardScorer(hang) as scorer:
    hung = scorer.score("q", "hang", {}, "row 1")
    assert hung.parts == (0.0,) and hung.timeouts == 1 and scorer.counters["reward_timeouts"] == 1
    assert scorer.score("q", "fine", {}, "row 2").parts == (0.5,)  # a new worker took the next call
  with RewardScorer(dataclasses.replace(hang, on_error="stop")) as stopping:
    with pytest.raises(RewardError, match=r"'hang' timed out .*timeout_s.* on row 1"):
      stopping.score("q", "hang", {}, "row 1")


def test_a_reward_that_kills_its_worker_is_an_error(module_file):
  with RewardScorer(RewardConfig(functions=(f"{module_file}:die",), workers=1, on_error="zero")) as scorer:
    score = scorer.score("q", "c", {}, "row 1")
    assert score.parts == (0.0,) and score.errors == 1


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=20), st.integers(0, 99)), min_size=1, max_size=8))
def test_workers_score_as_the_sampler_thread_does(rows):
  config = RewardConfig(functions=("streamrl_jax.rewards.verifiers:numeric_answer",
                                   "streamrl_jax.rewards.verifiers:exact_match"), weights=(1.0, 0.25))
  with RewardScorer(dataclasses.replace(config, workers=0)) as inline, RewardScorer(config) as pooled:
    for completion, answer in rows:
      fields = {"answer": str(answer)}
      assert inline.score("q", completion, fields, "r") == pooled.score("q", completion, fields, "r")


# ---- preflight ------------------------------------------------------------------------------------
def test_preflight_names_a_missing_answer_column_and_a_bad_signature(tmp_path, module_file):
  from streamrl_jax.pipeline.preflight import check_rewards
  from streamrl_jax.tasks import FileTask, PromptFile

  data = tmp_path / "data.jsonl"
  data.write_text('{"question": "How heavy?", "answer": "3", "unit": "kg"}\n{"question": "How long?", "unit": "m"}\n')
  task = FileTask(PromptFile(data))
  with pytest.raises(ValueError, match=r"data.jsonl, row 2: no 'answer' column"):
    check_rewards(RewardConfig(), task)
  check_rewards(RewardConfig(functions=(f"{module_file}:echo_fields",)), task)
  with pytest.raises(RewardFunctionError, match="two_args"):
    check_rewards(RewardConfig(functions=(f"{module_file}:two_args",)), task)


def test_file_rows_carry_their_columns_and_a_stable_heldout_split(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  from streamrl_jax.tasks import FileTask, PromptFile, draw

  shards = tmp_path / "shards"
  shards.mkdir()
  rows = [{"prompt": f"question {i}", "unit": "kg", "answer": i} for i in range(40)]
  pq.write_table(pa.Table.from_pylist(rows[:25]), shards / "part-0.parquet")
  pq.write_table(pa.Table.from_pylist(rows[25:]), shards / "part-1.parquet")
  every = PromptFile(shards, "prompt")
  assert len(every) == 40 and every[26]["where"] == "part-1.parquet, row 2"
  assert every[26]["fields"] == {"unit": "kg", "answer": 26}
  train = PromptFile(shards, "prompt", split="train", heldout_fraction=0.25)
  heldout = PromptFile(shards, "prompt", split="heldout", heldout_fraction=0.25)
  names = lambda source: {source[i]["prompt"] for i in range(len(source))}  # noqa: E731
  assert names(train) | names(heldout) == names(every) and not names(train) & names(heldout)
  assert 0 < len(heldout) < 20
  prompt, row = draw(FileTask(train), np.random.default_rng(0))
  assert prompt in names(train) and row.fields["unit"] == "kg" and "row" in row.where
  bad = tmp_path / "bad.parquet"
  pq.write_table(pa.Table.from_pylist([{"prompt": "q", "blob": b"\x00"}]), bad)
  with pytest.raises(ValueError, match=r"bad.parquet, row 1: a column cannot be handed to a reward function"):
    PromptFile(bad, "prompt")


def test_gin_binds_reward_config(module_file):
  from streamrl_jax import gin_config

  gin_config.parse(bindings=[f"RewardConfig.functions = ['{module_file}:unit', 'streamrl_jax.rewards:exact_match']",
                             "RewardConfig.weights = [1, 0.5]", "RewardConfig.workers = 4"])
  config, _ = gin_config.build_run()
  assert config.sampler.reward == RewardConfig(functions=(f"{module_file}:unit", "streamrl_jax.rewards:exact_match"),
                                       weights=(1.0, 0.5), workers=4)


# ---- in the pipeline --------------------------------------------------------------------------------
PIPELINE_REWARDS = '''
from pathlib import Path

CALLS = [0]

def digits(prompt, completion, answer, **fields):
  """Dense: the fraction of digits. Raises on its 21st call while the trigger file exists."""
  CALLS[0] += 1
  if CALLS[0] == 21 and Path(__file__).with_name("trigger").exists():
    raise ArithmeticError("a bug in the user's reward")
  return sum(c.isdigit() for c in completion) / max(1, len(completion))

def short(prompt, completion, **fields):
  return float(len(completion) < 6)
'''


@pytest.mark.slow
def test_pipeline_logs_each_function_and_resumes_after_a_reward_error(tmp_path, monkeypatch):
  """A reward that raises in step 2 stops the run naming it (step 1 is checkpointed, nothing of step 2 trained) by
  the step of the metrics row that trains the sample once resumed; the resumed run (scoring in a worker) trains
  steps 2 and 3 once each, and every reward/<name> metric is the mean of the values in the samples it trained, which
  equal the functions applied to their decoded text."""
  from flax import nnx

  from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask
  from streamrl_jax.models import Transformer
  from streamrl_jax.pipeline.runner import run_pipeline
  from streamrl_jax.pipeline import runner as runner_module
  from streamrl_jax.streaming import SampleQueue
  from streamrl_jax.training.checkpoint import Checkpointer

  module = tmp_path / "pipeline_rewards.py"
  module.write_text(textwrap.dedent(PIPELINE_REWARDS))
  (tmp_path / "trigger").write_text("")
  got, taken = [], []  # shards taken by the trainer; they and the rows written, in order

  class RecordingQueue(SampleQueue):
    def get(self, timeout=None):
      shard = super().get(timeout)
      got.append(shard)
      taken.append(shard)
      return shard

  monkeypatch.setattr(runner_module, "SampleQueue", RecordingQueue)
  reward = RewardConfig(functions=(f"{module}:digits", f"{module}:short"), weights=(1.0, 0.5), workers=0)
  config = dataclasses.replace(BASE, mode="stream", sampler=dataclasses.replace(BASE.sampler, reward=reward))
  checkpointer = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
  model = Transformer(MODEL, rngs=nnx.Rngs(0))
  with pytest.raises(RewardError, match=r"'digits' raised ArithmeticError: a bug in the user's reward on prompt "
                                        r"'\d+\+\d+=', step \d+, group \d+, sample \d") as raised:
    run_pipeline(config, model, TOKENIZER, DigitTask(max_digits=3), hooks=RunHooks(checkpointer))
  named, group, index = map(int, re.search(r"step (\d+), group (\d+), sample (\d+)", str(raised.value)).groups())
  checkpointer.wait()
  assert checkpointer.latest_step() == 1
  (tmp_path / "trigger").unlink()
  got.clear()
  taken.clear()
  in_thread = dataclasses.replace(config.sampler, reward=dataclasses.replace(reward, workers=1))
  resumed = run_pipeline(dataclasses.replace(config, sampler=in_thread), model, TOKENIZER,
                         DigitTask(max_digits=3), hooks=RunHooks(checkpointer, resume=True, on_step=taken.append))
  assert [m["step"] for m in resumed.metrics] == [2, 3] and resumed.counters["prompts_submitted"] == 8
  at = next(i for i, s in enumerate(taken)
            if not isinstance(s, dict) and ((s.group_ids == group) & (s.sample_indices == index)).any())
  row = next(r for r in taken[at:] if isinstance(r, dict))  # the first row written once the sample was taken
  assert named == row["step"] == 2
  assert resumed.counters["samples_trained"] == 2 * 16
  digits, short = load_function(f"{module}:digits"), load_function(f"{module}:short")
  for m in resumed.metrics:
    shards = [s for s in got if s.steps[0] == m["step"] - 1]
    parts = np.concatenate([s.reward_parts for s in shards])
    assert len(parts) == 16 and m["reward_errors"] == m["reward_timeouts"] == 0
    np.testing.assert_allclose([m["reward/digits"], m["reward/short"]], parts.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(m["reward_mean"], np.concatenate([s.rewards for s in shards]).mean(), rtol=1e-6)
    for shard in shards:
      texts = [TOKENIZER.decode(row[mask].tolist()) for row, mask in zip(shard.tokens, shard.loss_mask)]
      expected = np.array([[digits("", t, answer=""), short("", t)] for t in texts], np.float32)
      np.testing.assert_allclose(shard.reward_parts, expected, rtol=1e-6)
      np.testing.assert_allclose(shard.rewards, expected @ np.float32([1.0, 0.5]), rtol=1e-6)


def test_the_trainer_refuses_shards_scored_by_another_reward_config():
  from streamrl_jax.pipeline.trainer.step_intake import IntakeRules, refusal
  from tests.pipeline_setup import BASE
  from tests.wire_samples import group_shard

  shard = group_shard([5, 6], step=0, group=1, functions=2)
  two_functions = RewardConfig(functions=("m:a", "m:b"))
  two = dataclasses.replace(BASE, sampler=dataclasses.replace(BASE.sampler, reward=two_functions))
  assert refusal(shard, IntakeRules.of(two.shape)) is None
  one = IntakeRules.of(BASE.shape)
  assert "holds 2 reward values a sample; this run's RewardConfig has 1 (task)" in refusal(shard, one)
