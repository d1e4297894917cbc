"""`streamrl scorer`: a teacher's or judge's stage of the run's step graph as a program of its own. It reads the run's
gin files (the graph, the model the stage names, the policy's tokenizer and the sampler's temperature), holds the
frozen model on this program's devices and answers the trainer's token rows with their scores over Arrow Flight
(`workflow.remote`), until Ctrl-C or SIGTERM. The trainer reaches it as a pool 'name=HOST:PORT' of
`WorkflowConfig.pools`, the stage bound to that pool."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command imports jax (through the config) only when it runs
  from streamrl_jax.job.config import JobConfig
  from streamrl_jax.pipeline.config import PipelineConfig
  from streamrl_jax.streaming.flight_server import TLSFiles

_log = logging.getLogger(__name__)


def add_scorer_parser(sub, common) -> None:
  from streamrl_jax.commands.roles import tls_group

  scorer = sub.add_parser("scorer", help="a teacher's or judge's stage of the step graph as a program of its own: "
                          "serves its scores to the trainer (WorkflowConfig.pools 'name=HOST:PORT')")
  common(scorer)
  scorer.add_argument("--stage", required=True, help="the graph's stage it serves (a teacher's or a judge's)")
  scorer.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve on (port 0: any free one, "
                      "printed and written to --address-file)")
  scorer.add_argument("--address-file", help="write the address served on to this file once listening")
  tls_group(scorer)
  scorer.set_defaults(run=cmd_scorer)


def cmd_scorer(args) -> int:
  from streamrl_jax import gin_config
  from streamrl_jax.streaming.flight_server import TLSFiles

  gin_config.parse(gin_config.run_files(args.config), args.set)
  config, job = gin_config.build_run()
  tls = TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
  server = open_scorer(config, job, args.stage, args.listen, tls)
  _log.info("scoring stage %r (%s) on %s", args.stage, server.info.kind, server.address)
  if args.address_file:
    Path(args.address_file).write_text(server.address)
  try:
    server.serve()
  except KeyboardInterrupt:
    pass
  finally:
    server.shutdown()
    _log.info("stopped after %d requests (%d rows, %d refused)", server.counters.requests, server.counters.rows,
              server.counters.refused)
  return 0


def open_scorer(config: PipelineConfig, job: JobConfig, stage: str, listen: str, tls: TLSFiles | None = None,
                devices: list | None = None):
  """A listening `ScorerFlightServer` for `stage` of `config`'s graph (its model on `devices`, default all of this
  program's); ValueError naming the stage when it scores with no teacher or judge."""
  import jax

  from streamrl_jax.meshes import MeshShape, mesh_from_devices
  from streamrl_jax.training.logprobs import Truncation
  from streamrl_jax.workflow.ops import resolve_op
  from streamrl_jax.workflow.pools import Student, frozen_model
  from streamrl_jax.workflow.remote import ScorerFlightServer

  kind = resolve_op(config.workflow.step_graph().stage(stage).op).model
  if kind not in ("teacher", "judge"):
    raise ValueError(f"--stage {stage!r}: a scorer program serves a teacher's or a judge's stage; graph "
                     f"{config.workflow.graph!r}'s {stage!r} scores with {kind or 'no model'}")
  model_config, tokenizer = job.model_spec()
  shape = config.shape
  devices = jax.devices() if devices is None else devices
  mesh = mesh_from_devices(devices, MeshShape(len(devices), 1, 1))
  score: Callable = frozen_model(kind, config.workflow, config.trainer, (shape.temperature, Truncation(
      shape.top_k, shape.top_p, shape.min_p)), Student(model_config.vocab_size, model_config.dtype, shape.longest,
                                                          tokenizer), mesh)
  host, _, port = listen.rpartition(":")
  return ScorerFlightServer(host, int(port), stage=stage, kind=kind, vocab_size=model_config.vocab_size, score=score,
                            tls=tls)
