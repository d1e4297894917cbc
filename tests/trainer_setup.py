"""A tiny trainer and its micro-batches, shared by the trainer, packing and KL tests."""

import jax
import numpy as np
from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, Trainer


CONFIG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


MESH_SHAPE = MeshShape(1, 4, 1)


def make_batch(rows: int, seed: int, length: int = 14):
  rng = np.random.default_rng(seed)
  prompt = rng.integers(2, 6, rows)
  completion = rng.integers(2, length - 6, rows)
  pos = np.arange(length)[None]
  valid = pos < (prompt + completion)[:, None]
  return dict(tokens=rng.integers(0, 48, (rows, length)).astype(np.int32), valid=valid,
              loss_mask=valid & (pos >= prompt[:, None]), advantages=rng.normal(size=rows).astype(np.float32),
              logprobs=rng.normal(-3.9, 0.2, (rows, length)).astype(np.float32),
              old_logprobs=rng.normal(-3.9, 0.2, (rows, length)).astype(np.float32))


def split_rows(batch, sizes):
  out, start = [], 0
  for n in sizes:
    out.append({k: v[start:start + n] for k, v in batch.items()})
    start += n
  return out


def trainer_for(graphdef, objective=None, mesh_devices=(4, 8), shape=MESH_SHAPE, **opt):
  mesh = mesh_from_devices(jax.devices()[mesh_devices[0]:mesh_devices[1]], shape)
  return Trainer(graphdef, OptimizerConfig(learning_rate=1e-2, **opt), objective or ObjectiveConfig(), mesh)


def mean_gradient(state):
  return jax.tree.map(lambda g: np.asarray(g) / float(state.sums["denominator"]), state.grad_sum)
