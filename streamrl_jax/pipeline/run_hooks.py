"""What a job wires into a run, in one process (`runner.run_pipeline`) or as the trainer program
(`trainer.program.serve_training`): its checkpoints, its stop request, where its rows and end go, its arms' outputs
and periodic evaluation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from streamrl_jax.stopping import StopRequest


@dataclasses.dataclass(frozen=True)
class RunHooks:
  """`checkpointer`: the trainer state is saved after every step (asynchronously); `resume` restores its latest and
  goes on with the next step. `stop`: a stop request the trainer honours at a step boundary (`RunStopped`).
  `on_step(row)` gets each step's metrics row; `on_end(timeline, counters, arm_counters)` the run's once the steps
  end, however they end. `arm_outputs`: each in-process follower arm's (checkpointer, on_step) by name; `run_id`:
  the run follower programs must belong to. `periodic_eval` (`metrics_log.PeriodicEval`): the held-out accuracy of
  the lead and each arm on the rows it is due. `donate_model`: the model's arrays are the run's to free
  (`initial_weights_donated`); the caller keeps its graph."""

  checkpointer: object = None
  resume: bool = False
  stop: StopRequest | None = None
  on_step: Callable[[dict], None] | None = None
  on_end: Callable[[dict, dict, dict], None] | None = None
  arm_outputs: dict | None = None
  run_id: str = ""
  periodic_eval: object = None
  donate_model: bool = False
