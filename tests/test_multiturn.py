"""Multi-turn rollouts with tools: the calculator's grammar and bounds, the environment, rows extended in
flight, masked tool tokens in samples and in the gradient, replay from the seed, and the pipeline."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.envs import CalculatorEnv, CalculatorError, EnvConfig, ToolRunner, evaluate, make_environment
from streamrl_jax.envs.calculator import format_value
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import Transformer
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.sampler.groups import samples_to_shard
from streamrl_jax.rewards import Score
from streamrl_jax.sampling.streaming_sampler import StreamingSampler
from streamrl_jax.sampling import EngineConfig, make_engine
from streamrl_jax.sampling import SamplerConfig
from streamrl_jax.tasks import MultiplyTask, multiply_reward
from streamrl_jax.types import SamplingParams
from tests.tool_rows import (MODEL, TOKENIZER, FixedTools, HeldTools, engine_and_params,  # noqa: F401
                             run_episode, steps_until)
from tests.trainer_setup import make_batch, mean_gradient, trainer_for


# ---- the calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("3457*29", "100253"), ("(1+2)*-3", "-9"), ("2**10", "1024"), ("7/2", "3.5"),
                                         ("-7//2", "-4"), ("17%5", "2"), (" 12 * 3 ", "36"),
                                         ("10**20/3", "33333333333333333333.333333"), ("-1/8", "-0.125")])
def test_the_calculator_evaluates_its_grammar(text, value):
  assert format_value(evaluate(text)) == value


@pytest.mark.parametrize("text, why", [
    ("__import__('os')", "Call is not allowed"), ("().__class__", "Attribute is not allowed"), ("x", "Name is not allowed"),
    ("9**9**9", "exponent 387420489"), ("10**100", "exponent 100"), ("99999999**64", "beyond 60 digits"),
    ("(" * 30 + "1" + ")" * 30, "nesting deeper than 24"), ("-" * 150 + "1", "nesting deeper than 24"),
    ("1" * 201, "201 characters"), ("1.5*2", "Constant is not allowed"), ("'a'*3", "Constant is not allowed"),
    ("1/0", "division by zero"), ("[1]", "List is not allowed"), ("lambda: 1", "Lambda is not allowed"),
    ("1;2", "not an expression"), ("", "not an expression")])
def test_the_calculator_refuses_what_is_not_arithmetic(text, why):
  with pytest.raises(CalculatorError, match=why.replace("(", r"\(").replace("*", r"\*")):
    evaluate(text)


@settings(max_examples=60, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.sampled_from("+-*"))
def test_the_calculator_agrees_with_python_on_integers(a, b, op):
  expected = {"+": a + b, "-": a - b, "*": a * b}[op]
  assert evaluate(f"{a}{op}({b})") == expected


def test_a_malicious_call_gets_an_error_observation_and_has_no_effect(monkeypatch):
  env = CalculatorEnv(max_turns=3)
  called = []
  monkeypatch.setattr("builtins.__import__", lambda *a, **k: called.append(a) or pytest.fail("imported"))
  state, obs = env.step(env.reset("1*1=", 0), "<__import__('os').system('true')>")
  monkeypatch.undo()
  assert obs.text == "error: Call is not allowed" and not obs.done and state.turns == 1 and not called
  for turn in ("<9**9**9>", "<" + "(" * 40 + "1" + ")" * 40 + ">"):
    state, obs = env.step(state, turn)
    assert obs.text.startswith("error: ") and not obs.done
  state, obs = env.step(state, "<1+1>")
  assert obs.done and obs.text == ""  # the turn limit ends the episode


def test_the_environment_is_pure_and_calls_parse_from_the_end_of_the_turn():
  env = make_environment("calculator", max_turns=2)
  first = env.reset("12*34=", 0)
  assert env.step(first, "some text <12*34>") == env.step(first, "some text <12*34>")
  assert env.step(first, "<12*34>")[1].text == "408" and first.turns == 0
  assert env.step(first, "no call>")[1].text == "error: no call"
  with pytest.raises(ValueError, match="unknown environment 'abacus'; known: \\['calculator'\\]"):
    make_environment("abacus")
  with pytest.raises(ValueError, match="max_turns must be >= 1"):
    make_environment("calculator", max_turns=0)


def test_the_multiply_task_and_its_reward():
  rng = np.random.default_rng(0)
  prompt, worked = MultiplyTask(3).sample(rng)
  a, b = map(int, prompt[:-1].split("*"))
  assert worked == f"<{a}*{b}>{a * b};={a * b}" and multiply_reward(prompt, worked) == 1.0
  assert MultiplyTask(3, tool=False).sample(np.random.default_rng(0))[1] == f";={a * b}"
  assert multiply_reward("12*34=", "<12*34>408;=409") == 0.0 and multiply_reward("12*34=", ";=408") == 1.0


# ---- rows extended in flight ---------------------------------------------------------------------
def test_a_row_extended_in_flight_decodes_as_one_prefilled_with_the_whole_history(engine_and_params):
  engine, params = engine_and_params
  prompt = TOKENIZER.encode("12*34=")
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=24, stop_token_ids=(TOKENIZER.eos_id,))
  plain, _ = run_episode(engine, params, prompt, greedy)
  tokens = plain.completion_tokens.tolist()
  j = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # a token first seen at i >= 2
  observation = TOKENIZER.encode("408")
  tools = FixedTools(tokens[j], observation)
  extended, sampler = run_episode(engine, params, prompt, greedy, tools)
  got = extended.completion_tokens.tolist()
  assert got[:j + 1] == tokens[:j + 1] and got[j + 1:j + 4] == observation and sampler.counters["extend_calls"] == 1
  assert extended.loss_mask.tolist() == [True] * (j + 1) + [False] * 3 + [True] * (len(got) - j - 4)
  assert extended.logprobs[j + 1:j + 4].tolist() == [0.0] * 3
  # The same history prefilled at once, then decoded greedily: the same tokens after the observation.
  reference, _ = run_episode(engine, params, np.asarray(prompt + got[:j + 4]),
                      dict(greedy, max_new_tokens=len(got) - j - 4, stop_token_ids=(TOKENIZER.eos_id, tokens[j])))
  after = got[j + 4:]
  assert reference.completion_tokens.tolist()[:len(after)] == after and len(after) >= 1


def test_an_episode_replays_identically_from_its_seed(engine_and_params):
  engine, params = engine_and_params
  runner = ToolRunner(make_environment("calculator", max_turns=2), TOKENIZER)
  try:
    knobs = dict(temperature=1.5, max_new_tokens=32, stop_token_ids=(TOKENIZER.eos_id,))
    runs = []
    for _ in range(2):
      sampler = StreamingSampler([engine], params, tools=runner, seed=11)
      for g in range(6):
        sampler.submit(TOKENIZER.encode(f"{g}3*4{g}="), SamplingParams(**knobs), group_id=g)
      runs.append({s.group_id: (s.completion_tokens.tolist(), None if s.loss_mask is None else s.loss_mask.tolist(),
                                s.finish_reason) for s in sampler.stream()})
      assert sampler.counters["tool_calls"] >= 1, "the random model made no call: pick another seed"
    assert runs[0] == runs[1]
  finally:
    runner.close()


def test_a_row_waiting_on_a_tool_never_holds_up_the_other_rows(engine_and_params):
  engine, params = engine_and_params
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=20, stop_token_ids=(TOKENIZER.eos_id,))
  a = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  b = run_episode(engine, params, TOKENIZER.encode("5*6="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(a)) if a[i] not in a[:i] and a[i] not in b)
  tools = HeldTools(a[j], TOKENIZER.encode("408"))
  sampler = StreamingSampler([engine], params, tools=tools)
  sampler.submit(TOKENIZER.encode("12*34="), SamplingParams(**greedy), group_id=0)
  sampler.submit(TOKENIZER.encode("5*6="), SamplingParams(**greedy), group_id=1)
  finished = steps_until(sampler, [], lambda done: done)  # the call stays unanswered: b decodes to its end
  assert [s.group_id for s in finished] == [1] and finished[0].completion_tokens.tolist() == b
  assert len(tools.calls) == 1 and sampler.num_in_flight == 1  # row a, paused on its call
  tools.release()
  finished = steps_until(sampler, finished, lambda done: not sampler.has_work())
  assert [s.group_id for s in finished] == [1, 0]
  assert finished[1].completion_tokens.tolist()[:j + 4] == a[:j + 1] + TOKENIZER.encode("408")


# ---- masks in samples and in the gradient ----------------------------------------------------------
def test_tool_tokens_carry_loss_mask_zero_into_the_shard(engine_and_params):
  engine, params = engine_and_params
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=24, stop_token_ids=(TOKENIZER.eos_id,))
  tokens = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
  sample, _ = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy, FixedTools(tokens[j], [5, 6]))
  shard = samples_to_shard([sample], [Score(1.0, (1.0,))], width=40, step=0)
  p = len(sample.prompt_tokens)
  assert shard.loss_mask[0, p:p + j + 1].all() and not shard.loss_mask[0, p + j + 1:p + j + 3].any()
  assert shard.loss_mask[0, p + j + 3:p + sample.num_tokens].all() and not shard.loss_mask[0, :p].any()


@pytest.fixture(scope="module")
def tiny_trainer():
  from tests.trainer_setup import CONFIG
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  return trainer_for(graphdef), params


def _gradient(trainer, params, batch):
  return mean_gradient(trainer.accumulate(trainer.init_state(params), batch))


def _same(a, b) -> bool:
  return all(np.allclose(x, y, rtol=1e-5, atol=1e-8) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_changing_tool_tokens_leaves_the_gradient_unchanged(tiny_trainer):
  """Tool tokens (loss mask 0) at the end of each row, and the sampler's numbers of tool tokens anywhere: the
  gradient does not see them. With the mask on, the same change moves it (so the test can fail)."""
  trainer, params = tiny_trainer
  batch = make_batch(4, seed=5)
  last = np.asarray([np.flatnonzero(row).max() for row in batch["loss_mask"]])
  tool = np.zeros_like(batch["loss_mask"])
  for row, end in enumerate(last):
    tool[row, end - 2:end + 1] = True  # the row's last three tokens: an observation that ended the episode
  tool &= batch["loss_mask"]
  masked = dict(batch, loss_mask=batch["loss_mask"] & ~tool)
  base = _gradient(trainer, params, masked)
  rng = np.random.default_rng(1)
  other_tokens = np.where(tool, rng.integers(0, 48, tool.shape), batch["tokens"]).astype(np.int32)
  other_numbers = dict(masked, tokens=other_tokens,
                       logprobs=np.where(tool | ~masked["loss_mask"], -50.0, batch["logprobs"]))
  assert _same(base, _gradient(trainer, params, other_numbers))
  unmasked = _gradient(trainer, params, dict(batch, tokens=other_tokens))
  assert not _same(_gradient(trainer, params, batch), unmasked)


# ---- the pipeline ------------------------------------------------------------------------------------
def test_the_run_config_refuses_what_multi_turn_cannot_do():
  with pytest.raises(ValueError, match="unknown environment 'abacus'"):
    EnvConfig(environment="abacus")
  engine = EngineConfig(kv_layout="paged", page_size=16, max_prompt_length=48, max_new_tokens=48)
  PipelineConfig(sampler=SamplerConfig(env=EnvConfig(environment="calculator"), engine=engine))  # on pages too
  with pytest.raises(ValueError, match="tool_threads must be >= 1"):
    EnvConfig(environment="calculator", tool_threads=0)
  assert PipelineConfig(sampler=SamplerConfig(env=EnvConfig(environment="calculator"))).sampler.env.max_turns == 2


def test_a_parked_row_gives_its_slot_to_a_queued_request_and_comes_back_the_same(engine_and_params):
  """One slot: row a pauses on its call while b is queued, so a is parked off the slot and b runs there; when
  the tool returns, a comes back and ends with the tokens it has unparked (the extended-row case above)."""
  engine, params = engine_and_params
  # One slot; a paged pool of two rows' pages, since a parked row keeps its pages while the slot decodes another.
  one = make_engine(engine.graphdef, MODEL, dataclasses.replace(engine.config, num_slots=1, kv_pages=16),
                    single_device_mesh())
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=20, stop_token_ids=(TOKENIZER.eos_id,))
  a = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  b = run_episode(engine, params, TOKENIZER.encode("5*6="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(a)) if a[i] not in a[:i] and a[i] not in b)
  unparked = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy, FixedTools(a[j], [5, 6, 7]))[0]
  tools = HeldTools(a[j], [5, 6, 7])
  sampler = StreamingSampler([one], params, tools=tools)
  sampler.submit(TOKENIZER.encode("12*34="), SamplingParams(**greedy), group_id=0)
  sampler.submit(TOKENIZER.encode("5*6="), SamplingParams(**greedy), group_id=1)
  finished = steps_until(sampler, [], lambda done: done)
  assert sampler.counters["parked"] == 1 and [s.group_id for s in finished] == [1]
  assert finished[0].completion_tokens.tolist() == b
  tools.release()
  finished = steps_until(sampler, finished, lambda done: not sampler.has_work())
  assert [s.group_id for s in finished] == [1, 0]
  assert finished[1].completion_tokens.tolist() == unparked.completion_tokens.tolist()
  assert finished[1].loss_mask.tolist() == unparked.loss_mask.tolist()


@pytest.mark.slow
def test_episodes_cross_processes_like_single_turn_samples(tmp_path):
  """A trainer and two samplers as processes, async in flight, on the multiplication task with the calculator:
  episodes with masked tool tokens pass the trainer's door, each step is trained once, and the tool is used."""
  import json
  from tests.processes import Programs, check_each_step_once
  steps = 3
  run = Programs(tmp_path, steps, mode="async")
  sets = ["EnvConfig.environment='calculator'", "TaskConfig.name='multiply'", "TaskConfig.multiply_digits=1",
          "JobConfig.warmup_steps=100", "PipelineConfig.max_new_tokens=16",
          "SamplerConfig.in_flight=True"]
  extra = [a for s in sets for a in ("--set", s)]
  try:
    run.start("trainer", "trainer", *extra)
    for name in ("s0", "s1"):
      run.start("sampler", name, *extra)
    assert run.wait_exit("trainer") == 0, run.tails()
    for name in ("s0", "s1"):
      assert run.wait_exit(name, timeout=60) == 0, run.tails()
  finally:
    run.kill_all()
  counters = check_each_step_once(tmp_path, steps)
  assert counters["flight_bad_batches"] == 0
  metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert sum(m["env_tokens"] for m in metrics) > 0  # trained episodes held the calculator's (masked) tokens
  evaluated = [json.loads(line) for line in (tmp_path / "eval_before.jsonl").read_text().splitlines()]
  assert any(">" in row["completion"] for row in evaluated), evaluated[:3]  # the warmed-up model calls the tool


class _Raising:
  stop = ">"

  def reset(self, prompt, seed):
    return 0

  def step(self, state, turn):
    raise KeyError("a broken environment")


def test_a_failing_environment_ends_its_episode_not_the_sampler(engine_and_params):
  engine, params = engine_and_params
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=20, stop_token_ids=(TOKENIZER.eos_id,))
  tokens = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
  runner = ToolRunner(_Raising(), TOKENIZER)
  runner.stop_ids = (tokens[j],)
  try:
    sample, sampler = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy, runner)
  finally:
    runner.close()
  assert sample.finish_reason == "turns" and sample.completion_tokens.tolist() == tokens[:j + 1]
  assert sampler.counters["tool_calls"] == 1


def test_a_handed_over_rollout_starts_its_episode_on_the_new_sampler(engine_and_params):
  from streamrl_jax.types import Rollout
  engine, params = engine_and_params
  greedy = dict(temperature=1.0, top_k=1, max_new_tokens=24, stop_token_ids=(TOKENIZER.eos_id,))
  tokens = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy)[0].completion_tokens.tolist()
  j = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
  whole = run_episode(engine, params, TOKENIZER.encode("12*34="), greedy, FixedTools(tokens[j], [5, 6]))[0]
  sampler = StreamingSampler([engine], params, tools=FixedTools(tokens[j], [5, 6]))
  sampler.submit(TOKENIZER.encode("12*34="), SamplingParams(**greedy), group_id=7,
                 progress=Rollout(7, 0, tuple(tokens[:2]), tuple(whole.logprobs[:2].tolist()), (0, 0)))
  (resumed,) = list(sampler.stream())
  assert resumed.completion_tokens.tolist() == whole.completion_tokens.tolist()
  assert resumed.loss_mask.tolist() == whole.loss_mask.tolist()


def test_tools_need_engines_that_extend_rows():
  import types
  with pytest.raises(ValueError, match="multi-turn tools need engines that extend rows"):
    StreamingSampler([types.SimpleNamespace()], None, tools=FixedTools(1, []))
