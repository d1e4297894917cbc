"""The controller's step plan across sampler processes: how a step's prompts are cut into leases."""


import numpy as np

from streamrl_jax.messages import LeaseRequest, Published, Register
from streamrl_jax.models import CharTokenizer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.controller import Controller
from streamrl_jax.scheduling import SchedulingConfig
from streamrl_jax.tasks import ArithmeticTask
from streamrl_jax.pipeline.parts import controller_setup


class ScriptedRanker:
  """Scores that make prompts 3 and 7 of every step the predicted-longest; a long-tailed history."""

  history_lengths = np.concatenate([np.full(80, 10.0), np.full(20, 200.0)])
  counters = {"train_steps": 0}

  def scores(self, encoded):
    scores = np.arange(len(encoded), dtype=float) / 100
    scores[[3, 7]] = [5.0, 6.0]
    return scores

  def observe(self, encoded, lengths):
    pass


def leases_of_step_0(policy: str, samplers: int = 2) -> list:
  config = PipelineConfig(mode="stream", steps=2, prompts_per_step=10, group_size=2, max_new_tokens=8,
                          scheduling=SchedulingConfig(policy=policy))
  controller = Controller(controller_setup(config), ArithmeticTask(max_digits=2), CharTokenizer(), start_step=0,
                          ranker=ScriptedRanker())
  ids = [controller.register(Register(f"s{i}", {})).sampler_id for i in range(samplers)]
  controller.published(Published(0))
  return [controller.lease(LeaseRequest(ids[0], 0.0)).lease for _ in range(samplers)]


def test_skew_aware_leases_put_the_predicted_longest_prompts_together():
  leases = leases_of_step_0("skew_aware")
  groups = sorted(tuple(sorted(lease.group_ids)) for lease in leases)
  assert groups == [(0, 1, 2, 4, 5, 6, 8, 9), (3, 7)]  # alpha 0.2 of 10 prompts: the two longest on one sampler
  for lease in leases:  # the predictions travel with the prompts they belong to
    assert all((p >= 100) == (g in (3, 7)) for g, p in zip(lease.group_ids, lease.predicted_lengths))


def test_fifo_leases_are_consecutive_slices_and_one_sampler_takes_the_whole_step():
  assert [lease.group_ids for lease in leases_of_step_0("fifo")] == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
  assert [lease.group_ids for lease in leases_of_step_0("skew_aware", samplers=1)] == [tuple(range(10))]


def test_leases_carry_their_prompts_token_ids_encoded_once_by_the_controller():
  from streamrl_jax.tasks.rows import prompt_tokens
  task, tokenizer = ArithmeticTask(max_digits=2), CharTokenizer()
  for lease in leases_of_step_0("skew_aware"):  # cut by the ranker: the ids travel with their own prompts
    assert len(lease.prompt_tokens) == len(lease.prompts) == len(lease.group_ids)
    assert [list(ids) for ids in lease.prompt_tokens] == [prompt_tokens(task, tokenizer, p) for p in lease.prompts]
