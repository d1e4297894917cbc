"""PPO as a step graph (`ppo`): GAE per token from a critic that scores and learns as stages, against hand-worked
advantages, the tested critic trainer composed by hand, and a run whose critic resumes from its checkpoint."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshConfig, MeshShape, mesh_from_devices
from streamrl_jax.models import Transformer, ValueModel
from streamrl_jax.pipeline.run_hooks import RunHooks
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.training import Buckets, OptimizerConfig, Trainer, TrainerConfig
from streamrl_jax.training.checkpoint import Checkpointer
from streamrl_jax.workflow import GraphError, WorkflowConfig
from streamrl_jax.workflow.critic import earlier, make_critic
from streamrl_jax.workflow.ops import token_gae
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask
from tests.trainer_setup import CONFIG, make_batch

MESH = MeshShape(1, 2, 1)


def test_gae_puts_each_samples_reward_on_its_last_loss_token():
  """gamma = lambda = 1: a loss token's advantage is the reward less its value, its return the reward; a row with no
  loss token has neither. gamma = 0.5, lambda = 0: one step's TD error, worked by hand."""
  mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], bool)
  values = np.array([[9, 0.5, 0.25, -1, 9], [9, 9, 0.5, 0.5, 2], [1, 1, 1, 1, 1]], np.float32)
  advantages, returns = token_gae(np.array([1.0, 0.0, 1.0]), values, mask)
  np.testing.assert_allclose(advantages, np.where(mask, np.array([[1.0], [0.0], [0.0]]) - values, 0.0))
  np.testing.assert_allclose(returns, np.where(mask, np.array([[1.0], [0.0], [0.0]]), 0.0))
  advantages, _ = token_gae(np.array([1.0, 0.0, 1.0]), values, mask, gamma=0.5, lam=0.0)
  np.testing.assert_allclose(advantages[0, 1:4], [0.5 * 0.25 - 0.5, 0.5 * -1 - 0.25, 1.0 + 1.0])
  np.testing.assert_allclose(advantages[1, 2:], [0.5 * 0.5 - 0.5, 0.5 * 2 - 0.5, -2.0])
  # two turns, an environment's tokens (off the mask) between them: the first turn's last token bootstraps from the
  # second turn's first, the reward reaches both turns
  turns = np.array([[0, 1, 1, 0, 0, 1, 1]], bool)
  values = np.array([[9, 0.5, 0.25, 7, 7, 0.125, -1]], np.float32)
  advantages, returns = token_gae(np.array([1.0]), values, turns)
  np.testing.assert_allclose(advantages, np.where(turns, 1.0 - values, 0.0))
  np.testing.assert_allclose(returns, np.where(turns, 1.0, 0.0))
  advantages, _ = token_gae(np.array([1.0]), values, turns, gamma=0.5, lam=0.0)
  np.testing.assert_allclose(advantages[0, [1, 2, 5, 6]], [0.5 * 0.25 - 0.5, 0.5 * 0.125 - 0.25, 0.5 * -1 - 0.125, 2.0])


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))


def _mesh():
  return mesh_from_devices(jax.devices()[2:4], MESH)


def test_the_critic_starts_as_the_policy_and_values_the_state_before_each_token(policy):
  graphdef, params = policy
  critic = make_critic(CONFIG, params, TrainerConfig(), _mesh(), width=16)
  trunk = nnx.state(nnx.merge(critic.trainer.graphdef, critic.state.params).trunk)
  for a, b in zip(jax.tree.leaves(trunk), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  batch = make_batch(5, seed=1)
  assert not np.any(critic(batch["tokens"], batch["valid"]))  # the head starts at zero
  head = critic.state.params["value_head"]
  head[...] = jax.device_put(np.random.default_rng(2).normal(size=head[...].shape).astype(np.float32),
                             head[...].sharding)
  model = nnx.merge(critic.trainer.graphdef, jax.tree.map(np.asarray, critic.state.params))
  out = np.asarray(model(batch["tokens"], batch["valid"]))
  values = critic(batch["tokens"], batch["valid"])
  assert np.all(values[:, 0] == 0)
  np.testing.assert_allclose(values[:, 1:][batch["valid"][:, 1:]], out[:, :-1][batch["valid"][:, 1:]], atol=1e-5)


def test_the_critic_stage_learns_as_the_critic_trainer_does_by_hand(policy, tmp_path):
  """Two shards fed to the critic stage and one step equal, bit for bit, the critic trainer (`Trainer(role="critic")`,
  tested against numpy in test_trainer) given the same rows, each row's returns and old values moved one column
  earlier (the value model's output at t - 1 is token t's); the state checkpoints beside another and restores by
  name."""
  graphdef, params = policy
  config = TrainerConfig(optimizer=OptimizerConfig(learning_rate=1e-2))
  critic = make_critic(CONFIG, params, config, _mesh(), width=16)
  batch = make_batch(6, seed=3)
  rng = np.random.default_rng(3)
  values = critic(batch["tokens"], batch["valid"])
  returns = np.where(batch["loss_mask"], rng.normal(size=batch["tokens"].shape), 0.0).astype(np.float32)
  for rows in (slice(0, 2), slice(2, 6)):
    critic.accumulate(batch["tokens"][rows], batch["valid"][rows], batch["loss_mask"][rows], values[rows],
                      returns[rows])
  metrics = critic.end_step()
  assert set(metrics) == {"critic/loss", "critic/grad_norm", "critic/clip_frac"} and metrics["critic/loss"] > 0
  assert critic.end_step() == {}  # nothing added since: no step

  value_graphdef, value_params = nnx.split(ValueModel(CONFIG, rngs=nnx.Rngs(0)))
  value_params["trunk"] = params
  by_hand = Trainer(value_graphdef, config.optimizer, config.objective, _mesh(), role="critic", config=config,
                    buckets=Buckets(min_length=16))
  state = by_hand.init_state(value_params)
  for rows in (slice(0, 2), slice(2, 6)):
    state = by_hand.accumulate(state, dict(
        tokens=batch["tokens"][rows], valid=batch["valid"][rows], loss_mask=earlier(batch["loss_mask"][rows]),
        returns=earlier(returns[rows]), old_values=earlier(values[rows])))
  state, expected = by_hand.apply(state)
  assert metrics["critic/loss"] == expected["loss"]
  for a, b in zip(jax.tree.leaves(critic.state.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # exact: the same calls in the same order

  checkpointer = Checkpointer(tmp_path / "saved")
  checkpointer.save(state, step=1)  # a run without a critic
  with pytest.raises(FileNotFoundError, match="holds no critic state"):
    checkpointer.restore(critic.state, item="critic")
  checkpointer.save(state, step=2, others={"critic": critic.state})
  restored, _ = checkpointer.restore(make_critic(CONFIG, params, config, _mesh(), width=16).state, item="critic")
  for a, b in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                  jax.tree.leaves((critic.state.params, critic.state.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  checkpointer.close()


def test_a_critic_on_two_pools_and_a_token_level_advantage_key_are_refused():
  with pytest.raises(GraphError, match="graph='ppo'"):
    WorkflowConfig(advantage="gae")
  with pytest.raises(GraphError, match=r"stages \['critic', 'values'\] score with one critic model: bind them to one"):
    WorkflowConfig(graph="ppo", pools=("critic=2",), bind=("values=critic",)).order()
  WorkflowConfig(graph="ppo", pools=("critic=2",), bind=("values=critic", "critic=critic")).order()
  with pytest.raises(GraphError, match="WorkflowConfig.critic_learning_rate must be >= 0"):
    WorkflowConfig(graph="ppo", critic_learning_rate=-1.0)


def test_the_critic_learns_at_its_own_rate_where_one_is_set(policy):
  from streamrl_jax.workflow.pools import Student, trainer_flow
  _, params = policy
  for rate, expected in ((0.0, 3e-3), (0.25, 0.25)):
    config = TrainerConfig(optimizer=OptimizerConfig(learning_rate=3e-3))
    flow = trainer_flow(WorkflowConfig(graph="ppo", critic_learning_rate=rate), config, "grpo", (1.0, None),
                        {"trainer": _mesh()}, Student(CONFIG.vocab_size, "float32", 16, policy=(CONFIG, params)), None)
    assert flow.learners["critic"].trainer.optimizer_config.learning_rate == expected


def _ppo(steps, hooks=RunHooks()):
  """The ppo graph, its critic on 2 devices of its own."""
  workflow = WorkflowConfig(graph="ppo", pools=("critic=2",), bind=("values=critic", "critic=critic"))
  config = dataclasses.replace(BASE, mode="stream", steps=steps, workflow=workflow,
                               mesh=MeshConfig(sampler_devices=2, trainer_devices=4))
  return run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, DigitTask(max_digits=3), hooks=hooks)


def test_ppo_trains_policy_and_critic_and_its_critic_resumes_from_the_checkpoint(tmp_path):
  """3 steps straight, and 2 then a resume: the resumed step's critic values equal the straight run's (a fresh
  critic's are 0), and so do the weights."""
  straight = _ppo(3)
  rows = straight.metrics
  assert all({"critic/loss", "critic/grad_norm", "stage/values", "stage/returns"} <= set(r) for r in rows)
  assert rows[0]["stage/values"] == 0 and rows[2]["stage/values"] != 0  # the critic learned from step 1's returns
  checkpointer = Checkpointer(tmp_path, max_to_keep=2)
  _ppo(2, RunHooks(checkpointer))
  resumed = _ppo(3, RunHooks(Checkpointer(tmp_path, max_to_keep=2), resume=True))  # as a new program finds it
  assert [r["step"] for r in resumed.metrics] == [3]
  assert resumed.metrics[0]["stage/values"] == pytest.approx(rows[2]["stage/values"], rel=1e-4)
  for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
