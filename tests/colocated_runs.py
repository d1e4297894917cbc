"""The tiny pipeline in colocated mode on exactly 2 CPU devices (the trainer's parameters sharded over both,
so its steps hold all-gathers and all-reduces, on the sampler's devices), a checkpoint after every step;
RUNS runs of STEPS steps. Prints one JSON line per finished run. Run as its own process: the device count is
fixed before jax starts. `python -m tests.colocated_runs WORKDIR RUNS STEPS`"""

import os
import sys

from tests.xla_flags import xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = xla_flags(devices=2)
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from streamrl_jax import launch  # noqa: E402
from streamrl_jax.meshes import pipeline_meshes  # noqa: E402
from streamrl_jax.models import Transformer, state_shardings  # noqa: E402
from streamrl_jax.pipeline.runner import run_pipeline  # noqa: E402
from streamrl_jax.training.checkpoint import Checkpointer  # noqa: E402
from streamrl_jax.pipeline.run_hooks import RunHooks
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask  # noqa: E402


def main(workdir: Path, runs: int, steps: int) -> None:
  config = dataclasses.replace(BASE, mode="colocated", steps=steps, prompts_per_step=2, group_size=2)
  for run in range(runs):
    checkpointer = Checkpointer(workdir / f"run{run}", max_to_keep=1)
    try:
      result = run_pipeline(config, Transformer(MODEL, rngs=nnx.Rngs(run)), TOKENIZER, DigitTask(max_digits=3),
                            hooks=RunHooks(checkpointer))
    finally:
      checkpointer.close()
    launches = [[list(ids), name, finish, n] for (ids, name, finish), n in sorted(launch.tally().items())]
    print(json.dumps(dict(run=run, steps=[m["step"] for m in result.metrics], checkpoint=checkpointer.latest_step(),
                          devices=len(jax.devices()), split_parameters=split_parameters(config),
                          launches=launches)), flush=True)


def split_parameters(config) -> int:
  """How many of the model's parameter arrays the trainer's mesh splits over its devices."""
  _, trainer_mesh = pipeline_meshes(config.mesh, config.spec.shared_mesh)
  shardings = state_shardings(nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))[1], trainer_mesh)
  return sum(not s.is_fully_replicated for s in jax.tree.leaves(shardings))


if __name__ == "__main__":
  main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
