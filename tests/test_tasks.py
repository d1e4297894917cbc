"""Tasks and their rewards: hand-worked cases, properties, malformed files, resumable prompt streams."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl_jax.models import CharTokenizer
from streamrl_jax.tasks.heldout import accuracy, evaluation_where, heldout_prompts
from streamrl_jax.tasks.rows import Row, draw
from streamrl_jax.tasks import (ArithmeticTask, CountdownTask, FileTask, PromptFile, arithmetic_reward, countdown_reward,
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
    PromptFile(path, answer_key="answer")
  assert FileTask(PromptFile(path)).missing_answer().endswith("data.jsonl, row 2")  # needed by the built-in verifier only
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


def test_sums_reward_by_hand():
  from streamrl_jax.tasks import format_ok, sums_reward

  prompt = "What is 47 + 85? Reply with only the number."
  assert sums_reward(prompt, "132") == 1.0
  assert sums_reward(prompt, "47 + 85 = 132") == 1.0  # the last integer counts
  assert sums_reward(prompt, "The answer is 1,32.") == 1.0  # commas between digits are ignored
  assert sums_reward(prompt, "132, or maybe 133") == 0.0
  assert sums_reward(prompt, "-132") == 0.0 and sums_reward(prompt, "no number") == 0.0
  assert sums_reward("What is 1 + 2 + 3? Reply with only the number.", "6") == 1.0
  assert format_ok(" 132\n") and format_ok("1,320") and not format_ok("132.") and not format_ok("It is 132")
  with pytest.raises(ValueError, match="not a sums prompt"):
    sums_reward("47+85=", "132")


@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(2, 3))
def test_sums_splits_are_disjoint_and_answers_right(seed, digits, terms):
  from streamrl_jax.tasks import SumsTask, sums_reward
  from streamrl_jax.tasks.sums import is_heldout

  rng = np.random.default_rng(seed)
  for split in ("train", "heldout"):
    prompt, answer = SumsTask(digits, terms, split).sample(rng)
    numbers = tuple(int(t) for t in prompt[len("What is "):-len("? Reply with only the number.")].split(" + "))
    assert len(numbers) == terms and all(len(str(n)) == digits or (digits == 1 and n < 10) for n in numbers)
    assert is_heldout(numbers) == (split == "heldout") and int(answer) == sum(numbers)
    assert sums_reward(prompt, answer) == 1.0


def test_heldout_is_a_fifth_of_the_two_digit_pairs():
  from streamrl_jax.tasks.sums import is_heldout

  share = np.mean([is_heldout((a, b)) for a in range(10, 100) for b in range(10, 100)])
  assert 0.17 < share < 0.23


def test_chat_task_wraps_prompts_and_rewards_the_question():
  from streamrl_jax.models.chat import ChatFormat
  from streamrl_jax.tasks import ChatTask, SumsTask

  chat = ChatFormat.of("<s>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}{{ '\\nassistant: ' }}")
  task = ChatTask(SumsTask(), chat)
  prompt, answer = task.sample(np.random.default_rng(0))
  assert prompt.startswith("<s>user: What is ") and prompt.endswith("number.\nassistant: ")
  assert task.reward(prompt, answer) == 1.0 and task.reward(prompt, answer + "1") == 0.0
  # The pipeline's route: the scorer gets the question, and the task's built-in verifier scores it.
  from streamrl_jax.rewards import RewardConfig, RewardScorer
  from streamrl_jax.tasks import draw, question, verifier

  prompt, row = draw(task, np.random.default_rng(1))
  with RewardScorer(RewardConfig(workers=0), builtin=verifier(task)) as scorer:
    right = scorer.score(question(task, prompt), row.fields["answer"], row.fields, "row 1")
    wrong = scorer.score(question(task, prompt), row.fields["answer"] + "1", row.fields, "row 1")
  assert (right.total, wrong.total) == (1.0, 0.0)


def test_job_config_refuses_real_tasks_without_a_model():
  from streamrl_jax.job.config import JobConfig
  from streamrl_jax.tasks.config import TaskConfig

  for bad, key in ((dict(name="sums"), "needs a pretrained model"), (dict(chat=True), "TaskConfig.chat needs")):
    with pytest.raises(ValueError, match=key):
      JobConfig(task=TaskConfig(**bad))
  job = JobConfig(model="smollm2-135m-instruct", task=TaskConfig(name="sums", chat=True))
  with pytest.raises(ValueError, match="has no chat template"):
    job.make_task(CharTokenizer())
  assert JobConfig(model="x", task=TaskConfig(name="sums")).make_task(split="eval").split == "heldout"


def test_each_built_in_tasks_row_holds_the_fields_it_lists_and_its_answer_is_right(capsys):
  from streamrl_jax import cli
  from streamrl_jax.rewards.functions import load_function
  from streamrl_jax.tasks.config import TASKS
  from streamrl_jax.tasks.listing import built_in_tasks, markdown

  listed = built_in_tasks(seed=3)
  assert [t.name for t in listed] == [n for n in TASKS if n != "file"]
  for task in listed:
    fields = {k: v for k, (v, _) in task.fields.items()}
    reward = load_function(task.reward)
    assert reward(task.prompt, fields.get("solution", fields["answer"])) == 1.0, task.name
    terms = [int(x) for x in re.findall(r"\d+", task.prompt)]
    expected = {"countdown": terms[-1], "sums": sum(terms)}.get(task.name, terms[0] * terms[1] if "*" in task.prompt
                                                                  else terms[0] + terms[1])
    assert int(fields["answer"]) == expected, task.name
  assert markdown() in (Path(__file__).resolve().parent.parent / "docs" / "own_task.md").read_text().replace("\n  ", "\n")
  assert cli.main(["tasks"]) == 0
  printed = capsys.readouterr().out
  assert all(f"{t.name}: prompt {t.prompt!r}" in printed for t in built_in_tasks())


def test_the_held_out_evaluation_draws_its_own_prompts_and_counts_a_reward_of_one_as_correct():
  task = ArithmeticTask(max_digits=2)
  rng = np.random.default_rng(10_000 + 3)
  assert heldout_prompts(task, 4, seed=3) == [draw(task, rng) for _ in range(4)]
  training = np.random.default_rng(3)
  assert heldout_prompts(task, 4, seed=3) != [draw(task, training) for _ in range(4)]
  assert accuracy([0.5, 1.0, 2.0, 0.999]) == 0.5 and accuracy(np.array([1.0], np.float32)) == 1.0
  assert evaluation_where("What is 2+3?", Row()) == "prompt 'What is 2+3?' (evaluation)"
  assert evaluation_where("q", Row("data.jsonl row 4")) == "data.jsonl row 4 (evaluation)"
