"""One process of a trainer of several (or a trainer of one) running each step graph's trainer stages in turn over one
fixed shard of two groups: `python -m tests.stage_processes OUT_DIR PROCESS PROCESSES PORT MODELS_DIR`. Each process
holds the tokens of its own samples alone (owner = sample index modulo the processes, zeros elsewhere, as the trainer's
shared view holds them: `pipeline.trainer.intake.shared_view`); the reference, the teacher, the judge and the critic
are sharded over every process's devices like the policy. Writes OUT_DIR/GRAPH-PROCESSES-PROCESS.npz a graph: the
flow's fields, their step sums, the critic's update and which samples this process owns.
tests/test_stage_processes.py compares 2 and 4 processes with one."""

from __future__ import annotations

import os
import sys

from tests.xla_flags import xla_flags

DEVICES = 2  # CPU devices a process
GRAPHS = ("kl_reference", "distill", "judge", "ppo")
MODEL = dict(vocab_size=86, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def shard(process: int, processes: int):
  """Two groups of four samples (prompts of 3 tokens, completions of 4 to 9; ids of the demo character tokenizer), this
  process's tokens alone."""
  import numpy as np

  from streamrl_jax.streaming import SampleShard

  rng = np.random.default_rng(11)
  n, width = 8, 14
  lengths = 3 + rng.integers(4, 10, n)
  valid = np.arange(width)[None] < lengths[:, None]
  loss_mask = valid & (np.arange(width)[None] >= 3)
  tokens = rng.integers(1, MODEL["vocab_size"], (n, width)) * valid
  logprobs = -rng.random((n, width)).astype(np.float32) * loss_mask
  owners = np.arange(n) % processes
  mine = (owners == process)[:, None] if processes > 1 else np.ones((n, 1), bool)
  return SampleShard(tokens=tokens * mine, valid=valid, loss_mask=loss_mask & mine, logprobs=logprobs * mine,
                     rewards=rng.random(n).astype(np.float32), group_ids=np.repeat([0, 1], 4),
                     sample_indices=np.tile(np.arange(4), 2), steps=np.ones(n, np.int64),
                     first_versions=np.zeros(n, np.int64), last_versions=np.zeros(n, np.int64),
                     owners=owners, token_stats=_stats(loss_mask, valid))


def _stats(loss_mask, valid):
  """The token statistics every process knows of every sample (its description's), counted from all its tokens."""
  import numpy as np

  from streamrl_jax.streaming.shard import STATS

  out = np.zeros((len(valid), len(STATS)), np.int64)
  out[:, 0] = loss_mask.sum(axis=1)
  return out


def main(argv: list[str]) -> int:
  out, process, processes, port, models = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
  os.environ["XLA_FLAGS"] = xla_flags(devices=DEVICES)
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  if processes > 1:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=process)
  for graph in GRAPHS:
    _run_graph(graph, f"{out}/{graph}-{processes}-{process}.npz", process, processes, models)
  return 0


def _run_graph(graph: str, out: str, process: int, processes: int, models: str) -> None:
  import jax
  import numpy as np
  from flax import nnx

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer
  from streamrl_jax.training import ObjectiveConfig, Scoring, Trainer, TrainerConfig
  from streamrl_jax.training.logprobs import Truncation
  from streamrl_jax.workflow.config import WorkflowConfig
  from streamrl_jax.workflow.flow import shard_fields
  from streamrl_jax.workflow.pools import Student, trainer_flow

  mesh = mesh_from_devices(jax.devices(), MeshShape(1, len(jax.devices()), 1))
  config = ModelConfig(**MODEL)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  kl = graph == "kl_reference"
  objective = ObjectiveConfig(kl_coef=0.1, kl_in_reward=True) if kl else ObjectiveConfig()
  trainer_config = TrainerConfig(objective=objective, chunk_rows=4)
  trainer = Trainer(graphdef, trainer_config.optimizer, objective, mesh, config=trainer_config,
                    scoring=Scoring(1.0, params if kl else None))
  workflow = WorkflowConfig(graph=graph, teacher=f"{models}/teacher" if graph == "distill" else "",
                            judge=f"{models}/judge" if graph == "judge" else "")
  student = Student(config.vocab_size, config.dtype, 16, CharTokenizer(), (config, params), seed=0)
  flow = trainer_flow(workflow, trainer_config, "grpo", (1.0, Truncation()), {"trainer": mesh}, student,
                      trainer.reference_logprobs if kl else None)
  view = shard(process, processes)
  fields = flow.run(shard_fields(view, owned=processes > 1))
  sums = flow.sums(fields)
  update = flow.end_step()
  np.savez(out, owned=view.owners == process if processes > 1 else np.ones(8, bool),
           sums=np.asarray([sums[k] for k in sorted(sums)]), sum_names=np.asarray(sorted(sums)),
           update=np.asarray([update[k] for k in sorted(update)]), update_names=np.asarray(sorted(update)),
           **{f"field_{k}": np.asarray(v) for k, v in fields.items() if k != "owners"})


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
