"""Tasks and their rewards: hand-worked cases, properties, malformed files, resumable prompt streams."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl_jax.models import CharTokenizer
from streamrl_jax.tasks import (ArithmeticTask, CountdownTask, PromptFile, arithmetic_reward, countdown_reward,
                                digit_count_probabilities, numeric_answer_reward, prompt_iterator, worked_solution)


def test_worked_solution_by_hand():
  assert worked_solution(47, 85) == "7+5=12;4+8+1=13;=132"
  assert worked_solution(5, 0) == "5+0=5;=5"
  assert worked_solution(999, 1) == "9+1=10;9+1=10;9+1=10;=1000"


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_arithmetic_reward_accepts_the_working_and_rejects_a_wrong_sum(a, b):
  prompt = f"{a}+{b}="
  assert arithmetic_reward(prompt, worked_solution(a, b)) == 1.0
  assert arithmetic_reward(prompt, worked_solution(a, b + 1)) == 0.0
  assert arithmetic_reward(prompt, f"{a + b}") == 0.0  # the answer needs its `;=` marker
  CharTokenizer().encode(prompt + worked_solution(a, b))  # every character is in the demo alphabet


def test_arithmetic_lengths_are_long_tailed():
  probs = digit_count_probabilities(8, 1.5)
  assert probs[0] > probs[-1] * 20 and np.isclose(probs.sum(), 1)
  rng = np.random.default_rng(0)
  lengths = np.array([len(ArithmeticTask().sample(rng)[1]) for _ in range(2000)])
  assert np.percentile(lengths, 95) > 3 * np.median(lengths)
  with pytest.raises(ValueError, match="not an arithmetic prompt"):
    arithmetic_reward("2*3=", "6")


def test_countdown_reward_by_hand():
  assert countdown_reward("3,5,7->22:", "3*5+7") == 1.0
  assert countdown_reward("3,5,7->22:", "(7+3)*5-28") == 0.0  # 28 is not given
  assert countdown_reward("3,5,7->10:", "5+5") == 0.0  # 5 used twice
  assert countdown_reward("4,8->2:", "8/4") == 1.0
  assert countdown_reward("4,8->2:", "__import__('os')") == 0.0
  assert countdown_reward("4,8->2:", "8/(4-4)") == 0.0
  rng = np.random.default_rng(1)
  for _ in range(50):
    prompt, solution = CountdownTask().sample(rng)
    assert countdown_reward(prompt, solution) == 1.0


def test_numeric_answer_verifier():
  assert numeric_answer_reward("Natalia sold 48 + 24 = 72 clips.\n#### 72", "so the answer is 72") == 1.0
  assert numeric_answer_reward("#### 1,200", "It costs 1200.") == 1.0
  assert numeric_answer_reward("#### 72", "72 or maybe 73") == 0.0
  with pytest.raises(ValueError, match="holds no number"):
    numeric_answer_reward("none", "1")


def test_prompt_file_errors_name_file_and_row(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "x"}\n')
  with pytest.raises(ValueError, match=r"data.jsonl, row 2: missing field 'answer'"):
    PromptFile(path)
  path.write_text('{"question": "1+1?", "answer": "2"}\n{oops\n')
  with pytest.raises(ValueError, match=r"data.jsonl, row 2: not valid JSON"):
    PromptFile(path)
  with pytest.raises(FileNotFoundError):
    PromptFile(tmp_path / "missing.jsonl")


def test_prompt_iterator_resumes_exactly(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(7)))
  source = PromptFile(path)
  first = prompt_iterator(source, seed=3)
  seen = [next(first)["row"] for _ in range(5)]
  state = first.get_state()
  rest = [next(first)["row"] for _ in range(6)]
  resumed = prompt_iterator(source, seed=3)
  resumed.set_state(state)
  assert [next(resumed)["row"] for _ in range(6)] == rest
  assert sorted(seen + rest[:2]) == list(range(1, 8))  # one epoch: every prompt once
