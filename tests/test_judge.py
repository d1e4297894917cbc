"""The `judge` graph: a second model's verdict on each sample as its reward, exact against the judge model's own
logits, and a run in async mode with the judge on a pool of its own."""

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshConfig, MeshShape, mesh_from_devices
from streamrl_jax.models import Transformer
from streamrl_jax.models.hf_io import save_hf
from streamrl_jax.workflow import WorkflowConfig
from streamrl_jax.workflow.judge import answer_tokens, load_judge
from streamrl_jax.workflow.pools import Student
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, run

QUESTION = "\nRight? Answer yes or no:"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("judge") / "model"
  save_hf(Transformer(MODEL, rngs=nnx.Rngs(11)), path)
  return path


def test_the_judges_reward_is_its_probability_of_yes_against_no_after_the_question(judge_dir):
  mesh = mesh_from_devices(jax.devices()[6:8], MeshShape(2, 1, 1))
  judge = load_judge(str(judge_dir), QUESTION, Student(MODEL.vocab_size, "float32", 10, TOKENIZER), mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, MODEL.vocab_size, (3, 10)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[1, 6:] = False  # a shorter sample: the question follows its last valid token
  model = Transformer(MODEL, rngs=nnx.Rngs(11))
  yes, no = answer_tokens(TOKENIZER)
  expected = []
  for row in range(3):
    sample = np.concatenate([tokens[row][valid[row]], TOKENIZER.encode(QUESTION)])[None]
    logits = np.asarray(model(sample, np.ones_like(sample, bool)), np.float64)[0, -1]
    expected.append(1.0 / (1.0 + np.exp(logits[no] - logits[yes])))
  np.testing.assert_allclose(judge(tokens, valid), expected, rtol=1e-4)
  judge(tokens[:2, :7], valid[:2, :7])  # another group's width and rows: the same program (its width: the longest)
  assert judge._score._cache_size() == 1
  assert (yes, no) == (TOKENIZER.encode("yes")[0], TOKENIZER.encode("no")[0])  # a space is a token of its own here


def test_a_judge_of_another_vocabulary_is_refused_by_name(judge_dir):
  mesh = mesh_from_devices(jax.devices()[6:8], MeshShape(2, 1, 1))
  with pytest.raises(ValueError, match="WorkflowConfig.judge=.* needs the same tokenizer"):
    load_judge(str(judge_dir), QUESTION, Student(MODEL.vocab_size + 1, "float32", 10, TOKENIZER), mesh)


def test_async_training_on_a_judges_verdicts_from_a_pool_of_its_own(judge_dir):
  workflow = WorkflowConfig(graph="judge", judge=str(judge_dir), judge_question=QUESTION, pools=("judge=2",),
                            bind=("judge=judge",))
  result = run("async", workflow=workflow, steps=3, mesh=MeshConfig(sampler_devices=2, trainer_devices=2))
  verdicts = [m["stage/judge_rewards"] for m in result.metrics]
  assert len(verdicts) == 3 and all(0.0 < v < 1.0 for v in verdicts), verdicts
  assert result.counters["samples_trained"] == BASE.samples_per_step * 3
  assert all(m["grad_norm"] > 0 for m in result.metrics)  # the verdicts differ within groups: a gradient
