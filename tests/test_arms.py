"""Follower arms in a run: every arm trains every sample of the lead's stream once, a follower with the lead's
algorithm ends where the lead does, a held or failing follower never holds the lead up, and a resumed run
restarts each follower from its own checkpoint."""

import dataclasses
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshConfig
from streamrl_jax.models import Transformer
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.arms.config import ArmConfig
from streamrl_jax.arms.config import ArmsConfig
from streamrl_jax.records.metrics_log import PeriodicEval
from streamrl_jax.training import ObjectiveConfig
from streamrl_jax.training.checkpoint import Checkpointer
from streamrl_jax.pipeline.run_hooks import RunHooks
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask

WAIT_S = 300.0  # a held follower is released by the lead's last row long before this; never reached when all is well


def arms_config(steps: int, arm_max_lag: int, *arms):
  return dataclasses.replace(BASE, mode="stream", steps=steps, mesh=MeshConfig(sampler_devices=4, trainer_devices=2),
                             arms=ArmsConfig(followers=arms, max_lag=arm_max_lag),
                             trainer=dataclasses.replace(BASE.trainer, objective=ObjectiveConfig(objective="ppo")))


def same_as_lead(name: str) -> ArmConfig:
  return ArmConfig(name, advantage=BASE.workflow.advantage, objective=ObjectiveConfig(objective="ppo"),
                   optimizer=BASE.trainer.optimizer, seed=BASE.seed)


class Outputs:
  """Each arm's checkpointer and rows; `fail_at` makes an arm's row of that step raise (its step is then not
  checkpointed), `hold` keeps an arm in its first row until the lead's last."""

  def __init__(self, root, names, fail_at=None, hold=()):
    self.rows = {name: [] for name in names}
    self.checkpointers = {name: Checkpointer(root / name, max_to_keep=2) for name in names}
    self.fail_at, self.hold, self.lead_done = fail_at or {}, set(hold), threading.Event()
    self.held_ok = {}

  def lead_row(self, total_steps: int):
    def on_step(row):
      if row["step"] == total_steps:
        self.lead_done.set()
    return on_step

  def sinks(self) -> dict:
    def sink(name):
      def on_step(row):
        if row["step"] == self.fail_at.get(name):
          raise RuntimeError(f"injected failure of arm {name}")
        if name in self.hold and name not in self.held_ok:
          self.held_ok[name] = self.lead_done.wait(WAIT_S)
        self.rows[name].append(row)
      return on_step
    return {name: (self.checkpointers[name], sink(name)) for name in self.rows}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("arms")
  config = arms_config(3, 10, same_as_lead("same"), ArmConfig("rloo", advantage="rloo"), same_as_lead("broken"))
  outputs = Outputs(root, ["same", "rloo", "broken"], fail_at={"broken": 2})
  lead = Checkpointer(root / "lead", max_to_keep=2)
  result = run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, DigitTask(max_digits=3),
                        hooks=RunHooks(lead, arm_outputs=outputs.sinks(), periodic_eval=PeriodicEval(2, weight_sum)))
  return root, config, outputs, lead, result


def weight_sum(params) -> dict[str, float]:
  """A stand-in held-out evaluation: a number that only the same parameters give."""
  return {"heldout_accuracy": float(sum(np.asarray(leaf, np.float64).sum() for leaf in jax.tree.leaves(params)))}


def test_every_arm_trains_every_sample_of_the_stream_once(first_run):
  _, config, outputs, _, result = first_run
  assert [m["arm"] for m in result.metrics] == ["lead"] * 3
  for name in ("same", "rloo"):
    counters = result.arms[name].counters
    assert counters["unique_samples_trained"] == counters["samples_planned"] == 3 * config.samples_per_step
    assert counters["samples_trained"] == counters["arm_samples_offered"] == 3 * config.samples_per_step
    assert counters["arm_steps_skipped"] == counters["duplicate_samples"] == counters["arm_failed"] == 0
    assert [r["step"] for r in outputs.rows[name]] == [1, 2, 3] and {r["arm"] for r in outputs.rows[name]} == {name}
    for lead_row, row in zip(result.metrics, outputs.rows[name]):  # one stream: the same samples' rewards
      assert row["reward_mean"] == lead_row["reward_mean"]


def test_a_follower_with_the_leads_algorithm_ends_at_the_leads_weights(first_run):
  _, _, outputs, _, result = first_run
  for lead, same in zip(jax.tree.leaves(result.params), jax.tree.leaves(result.arms["same"].params)):
    np.testing.assert_array_equal(np.asarray(lead), np.asarray(same))
  assert max(abs(np.asarray(a) - np.asarray(b)).max() for a, b in
             zip(jax.tree.leaves(result.params), jax.tree.leaves(result.arms["rloo"].params))) > 0
  # the follower on its own estimator drifts from the policy that samples; the one on the lead's does not
  assert outputs.rows["rloo"][-1]["arm_policy_divergence"] > 0
  assert outputs.rows["same"][-1]["arm_policy_divergence"] == pytest.approx(result.metrics[-1]["arm_policy_divergence"])
  # JobConfig.eval_every's evaluation, of each policy's own parameters after its step 2 only
  assert ["heldout_accuracy" in m for m in result.metrics] == [False, True, False]
  assert outputs.rows["same"][1]["heldout_accuracy"] == result.metrics[1]["heldout_accuracy"]
  assert outputs.rows["rloo"][1]["heldout_accuracy"] != result.metrics[1]["heldout_accuracy"]


def test_a_failing_follower_leaves_the_lead_and_the_others_running(first_run):
  _, _, outputs, lead, result = first_run
  assert result.arms["broken"].counters["arm_failed"] == 1 and result.arms["broken"].params is None
  assert [r["step"] for r in outputs.rows["broken"]] == [1]
  assert outputs.checkpointers["broken"].latest_step() == 1  # its step 2 never reached its checkpoint
  assert lead.latest_step() == 3 and len(result.metrics) == 3


def test_a_resumed_run_restarts_each_follower_from_its_checkpoint_and_a_held_one_skips(first_run):
  root, _, first, lead, _ = first_run
  config = arms_config(5, 0, same_as_lead("broken"), same_as_lead("held"))
  outputs = Outputs(root, ["broken", "held"], hold={"held"})
  assert outputs.checkpointers["broken"].latest_step() == 1
  result = run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, DigitTask(max_digits=3),
                        hooks=RunHooks(lead, resume=True, arm_outputs=outputs.sinks(),
                                       on_step=outputs.lead_row(config.steps)))
  assert [m["step"] for m in result.metrics] == [4, 5]
  assert outputs.held_ok == {"held": True}
  broken = result.arms["broken"].counters
  # resumed after its step 1: steps 2 and 3 were trained by the lead before the restart, so it skips them
  assert [r["step"] for r in outputs.rows["broken"]][:1] == [4]
  assert broken["arm_failed"] == 0 and broken["arm_steps_skipped"] + len(outputs.rows["broken"]) == 4
  held = result.arms["held"].counters
  # new in this run: steps 1-3 precede the lead's stream; held at step 4 until the lead's step 5, then 1 behind
  assert [r["step"] for r in outputs.rows["held"]] == [4]
  assert held["arm_steps_skipped"] == 4 and held["arm_samples_skipped"] == config.samples_per_step
  assert held["samples_trained"] + held["arm_samples_skipped"] + held["arm_samples_refused"] \
      == held["arm_samples_offered"]
