"""The supervised warm-up of the demo decoder: teacher-forced cross-entropy on (prompt, worked solution) pairs,
done once per workdir (kept as WORKDIR/warmup_model)."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from streamrl_jax.job.config import JobConfig
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.models import load_hf
from streamrl_jax.records.run_files import WARMUP_DIR, save_model
from streamrl_jax.tasks import prompt_tokens
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Trainer

_log = logging.getLogger(__name__)


def supervised_warmup(model, tokenizer, task, job: JobConfig, width: int):
  """Teacher-forced cross-entropy on (prompt, worked solution) pairs through the RL trainer with the
  `reinforce` objective and advantage 1: its loss is then the completion tokens' mean NLL."""
  graphdef, params = nnx.split(model)
  trainer = Trainer(graphdef, OptimizerConfig(learning_rate=job.warmup_learning_rate, warmup_steps=20),
                    ObjectiveConfig(objective="reinforce", correction="none"), single_device_mesh())
  state = trainer.init_state(params, seed=job.seed)
  rng = np.random.default_rng(job.seed + 1)
  for step in range(job.warmup_steps):
    batch = teacher_batch(tokenizer, task, [task.sample(rng) for _ in range(job.warmup_batch)], width)
    state, metrics = trainer.apply(trainer.accumulate(state, batch))
    if step % 100 == 0 or step == job.warmup_steps - 1:
      _log.info(f"warm-up step {step + 1}/{job.warmup_steps}: nll {metrics['loss']:.3f}")
  return nnx.merge(graphdef, jax.device_get(state.params))


def teacher_batch(tokenizer, task, pairs: list, width: int) -> dict:
  """The trainer's batch of (prompt, solution) `pairs`, `width` tokens a row: the solution and its end token are
  the scored tokens, each with advantage 1."""
  tokens = np.zeros((len(pairs), width), np.int32)
  valid = np.zeros((len(pairs), width), bool)
  for row, (prompt, solution) in enumerate(pairs):
    ids = prompt_tokens(task, tokenizer, prompt) + tokenizer.encode(solution) + [tokenizer.eos_id]
    tokens[row, :len(ids)], valid[row, :len(ids)] = ids[:width], True
  prompt_len = np.array([len(prompt_tokens(task, tokenizer, p)) for p, _ in pairs])[:, None]
  loss_mask = valid & (np.arange(width)[None] >= prompt_len)
  return dict(tokens=tokens, valid=valid, loss_mask=loss_mask, advantages=np.ones(len(pairs), np.float32),
              logprobs=np.zeros((len(pairs), width), np.float32))


def warm_model(job: JobConfig, task, workdir: Path, width: int, leader: bool):
  """(model, tokenizer): the job's model after its supervised warm-up (`width` tokens a row), which is done once and
  kept in WORKDIR/warmup_model (by process 0) for every later start."""
  model, tokenizer, warm_up = job.load_model()
  warm = Path(workdir) / WARMUP_DIR
  if warm_up and (warm / "config.json").exists():
    model = load_hf(warm, compute_dtype=job.dtype())
    _log.info(f"loaded the warm-up model from {warm}")
  elif warm_up:
    model = supervised_warmup(model, tokenizer, task, job, width)
    if leader:
      save_model(model, warm)
  return model, tokenizer
