"""On-policy distillation (the `distill` graph): a teacher's log-probabilities scored on a pool of its own, exact
against numpy, and a run that pulls the student's tokens toward the teacher's."""

import dataclasses

import jax
import numpy as np
from flax import nnx

from streamrl_jax.meshes import MeshConfig, MeshShape, mesh_from_devices
from streamrl_jax.models import Transformer
from streamrl_jax.models.hf_io import save_hf
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig
from streamrl_jax.training.call_loss import CallLoss
from streamrl_jax.workflow import WorkflowConfig
from streamrl_jax.workflow.teacher import load_teacher
from tests.pipeline_setup import BASE, MODEL, run
from tests.test_kl import numpy_logprobs


def test_the_teacher_scores_tokens_on_its_own_devices_as_numpy_does(tmp_path):
  teacher = Transformer(MODEL, rngs=nnx.Rngs(7))
  save_hf(teacher, tmp_path / "teacher")
  mesh = mesh_from_devices(jax.devices()[6:8], MeshShape(2, 1, 1))
  scorer = load_teacher(str(tmp_path / "teacher"), MODEL.vocab_size, "float32", mesh,
                        CallLoss(ObjectiveConfig(), BASE.trainer, 1.0), 16)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MODEL.vocab_size, (5, 13)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[0, 9:] = False
  graphdef, params = nnx.split(teacher)
  expected = numpy_logprobs(graphdef, params, tokens, valid)
  np.testing.assert_allclose(scorer(tokens, valid)[valid], expected[valid], atol=1e-4)
  assert {d.id for leaf in jax.tree.leaves(scorer.params) for d in leaf.devices()} == {6, 7}


def test_a_teacher_of_another_vocabulary_is_refused_by_name(tmp_path):
  save_hf(Transformer(MODEL, rngs=nnx.Rngs(7)), tmp_path / "teacher")
  mesh = mesh_from_devices(jax.devices()[6:8], MeshShape(2, 1, 1))
  try:
    load_teacher(str(tmp_path / "teacher"), MODEL.vocab_size + 1, "float32", mesh,
                 CallLoss(ObjectiveConfig(), BASE.trainer, 1.0), 16)
  except ValueError as err:
    assert "WorkflowConfig.teacher=" in str(err) and "same tokenizer" in str(err)
  else:
    raise AssertionError("a teacher of another vocabulary was taken")


def test_distill_pulls_the_student_toward_its_teacher(tmp_path):
  """The teacher: the tiny model after 10 RL steps at a sharp learning rate. The student, the same model fresh,
  distilled from it with the teacher on 2 devices of its own: the row's stage/advantages is minus the sampled tokens'
  reverse KL to the teacher, which falls (0.31 to 0.12 over 6 steps when this was written)."""
  sharp = dataclasses.replace(BASE.trainer, optimizer=OptimizerConfig(learning_rate=1e-2))
  taught = run("disaggregated", trainer=sharp, steps=10)
  graphdef, _ = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  save_hf(nnx.merge(graphdef, taught.params), tmp_path / "teacher")
  workflow = WorkflowConfig(graph="distill", teacher=str(tmp_path / "teacher"), pools=("teacher=2",),
                            bind=("teacher=teacher",))
  trainer = dataclasses.replace(BASE.trainer, optimizer=OptimizerConfig(learning_rate=3e-3))
  result = run("disaggregated", workflow=workflow, trainer=trainer, steps=8,
               mesh=MeshConfig(sampler_devices=2, trainer_devices=2))
  kl = [-m["stage/advantages"] for m in result.metrics]
  assert len(kl) == 8 and min(kl) > -0.1, kl
  assert np.mean(kl[-3:]) < 0.7 * np.mean(kl[:2]), kl
