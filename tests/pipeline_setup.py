"""The tiny in-process pipeline that several test modules run: model, tokenizer, task and base config."""

import dataclasses
from flax import nnx
from streamrl_jax.meshes import MeshConfig
from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer
from streamrl_jax.pipeline import PipelineConfig
from streamrl_jax.pipeline.runner import run_pipeline
from streamrl_jax.sampling import EngineConfig
from streamrl_jax.sampling import SamplerConfig
from streamrl_jax.tasks import ArithmeticTask


TOKENIZER = CharTokenizer()


MODEL = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)


class DigitTask(ArithmeticTask):
  """Arithmetic prompts with a dense reward (the fraction of digits in the completion), so that
  advantages and gradients are non-zero even for an untrained model."""

  @staticmethod
  def reward(prompt: str, completion: str) -> float:
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


BASE = PipelineConfig(steps=3, prompts_per_step=4, group_size=4, max_new_tokens=12, seed=1,
                      mesh=MeshConfig(sampler_devices=4, trainer_devices=4),
                      sampler=SamplerConfig(engine=EngineConfig(num_slots=8, max_prompt_length=16, max_new_tokens=12,
                                                                min_prefill_bucket=16)))


def run(mode: str, **overrides):
  config = dataclasses.replace(BASE, mode=mode, **overrides)
  return run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, DigitTask(max_digits=3))
