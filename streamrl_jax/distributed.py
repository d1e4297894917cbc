"""Several processes inside one role: `jax.distributed` for that role only, and what its processes share.

A role (the trainer, or one engine instance) may span processes (hosts): they form one JAX cluster and one
mesh, and run the same program in lockstep. Its process 0 holds the control (the controller, the plans); a trainer's
every process takes the samples it trains at its own door (`pipeline.trainer.intake`), and the weights process 0
publishes are all-gathered.

Where the cluster comes from, first found wins: the flags `--coordinator --num-processes --process-id`;
`STREAMRL_COORDINATOR`, `STREAMRL_NUM_PROCESSES`, `STREAMRL_PROCESS_ID`; a JobSet pod (`JOBSET_NAME`,
`REPLICATED_JOB_NAME`, `JOB_INDEX`, `JOB_COMPLETION_INDEX`, with `STREAMRL_NUM_PROCESSES`: process 0 is pod 0
of the job, reached by its stable DNS name); a TPU slice (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Mapping

import numpy as np

from streamrl_jax import launch

DEFAULT_COORDINATOR_PORT = 8476


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator: str  # HOST:PORT of the role's process 0
  num_processes: int
  process_id: int

  def __post_init__(self):
    host, _, port = self.coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"coordinator {self.coordinator!r}: expected HOST:PORT")
    if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process id {self.process_id} of {self.num_processes} processes is out of range")


def detect(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
           env: Mapping[str, str] = os.environ) -> DistributedConfig | None:
  """The role's cluster from flags or the environment (see the module doc); None: a single process."""
  flags = (coordinator, num_processes, process_id)
  if any(f is not None for f in flags):
    if any(f is None for f in flags):
      raise ValueError("--coordinator, --num-processes and --process-id go together")
    return DistributedConfig(coordinator, int(num_processes), int(process_id))
  port = int(env.get("STREAMRL_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT))
  if "STREAMRL_COORDINATOR" in env:
    return DistributedConfig(env["STREAMRL_COORDINATOR"], int(_need(env, "STREAMRL_NUM_PROCESSES")),
                             int(_need(env, "STREAMRL_PROCESS_ID")))
  if "JOBSET_NAME" in env and "JOB_COMPLETION_INDEX" in env and "STREAMRL_NUM_PROCESSES" in env:
    jobset, job = env["JOBSET_NAME"], _need(env, "REPLICATED_JOB_NAME")
    host = f"{jobset}-{job}-{env.get('JOB_INDEX', '0')}-0.{jobset}"
    return DistributedConfig(f"{host}:{port}", int(env["STREAMRL_NUM_PROCESSES"]), int(env["JOB_COMPLETION_INDEX"]))
  if "TPU_WORKER_HOSTNAMES" in env and "TPU_WORKER_ID" in env:
    hosts = [h for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h]
    if len(hosts) > 1:
      return DistributedConfig(f"{hosts[0]}:{port}", len(hosts), int(env["TPU_WORKER_ID"]))
  return None


def _need(env: Mapping[str, str], name: str) -> str:
  if name not in env:
    raise ValueError(f"the environment sets part of a multi-process role but not {name}")
  return env[name]


_STARTED: list[DistributedConfig] = []  # the cluster this process joined, if any


def initialize(config: DistributedConfig | None) -> None:
  """Starts `jax.distributed` for this role (no-op for a single process); call before any other jax use."""
  if config is None or config.num_processes == 1:
    return
  import jax
  jax.distributed.initialize(config.coordinator, num_processes=config.num_processes, process_id=config.process_id)
  _STARTED.append(config)


def advertised_host(listen_host: str, env: Mapping[str, str] = os.environ) -> str:
  """The host other processes dial for a server of this process listening on `listen_host`: that host, or for a
  wildcard address this pod's stable DNS name in a JobSet (as `detect` names process 0's), else this machine's name."""
  if listen_host not in ("0.0.0.0", "::", ""):
    return listen_host
  if "JOBSET_NAME" in env and "JOB_COMPLETION_INDEX" in env and "REPLICATED_JOB_NAME" in env:
    jobset = env["JOBSET_NAME"]
    return f"{jobset}-{env['REPLICATED_JOB_NAME']}-{env.get('JOB_INDEX', '0')}-{env['JOB_COMPLETION_INDEX']}.{jobset}"
  return socket.gethostname()


def coordinator_host() -> str:
  """The host of this role's process 0 (its `jax.distributed` coordinator); "" for a single process."""
  return _STARTED[0].coordinator.rpartition(":")[0] if _STARTED else ""


def joined() -> bool:
  """Whether this process is one of several in a jax.distributed cluster."""
  return bool(_STARTED)


def leave_on_failure(code: int) -> None:
  """A process of a multi-process role that fails leaves at once with `code`: at a normal exit it would wait
  in jax.distributed's shutdown for the others, which wait for it in turn, so the role would hang instead of
  failing (and a cluster would never restart it). Its death tells the others, whose coordination service
  then stops them. A no-op for a single process or on success."""
  if code and _STARTED:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_leader() -> bool:
  import jax
  return jax.process_index() == 0


def gather_text(text: str, limit: int = 255) -> list[str]:
  """Every process's `text` (an address, at most `limit` bytes of UTF-8), by process. Collective."""
  import jax
  from jax.experimental import multihost_utils

  raw = text.encode()
  if len(raw) > limit:
    raise ValueError(f"{text[:80]!r}: more than {limit} bytes")
  mine = np.zeros(limit + 1, np.uint8)
  mine[0], mine[1:len(raw) + 1] = len(raw), np.frombuffer(raw, np.uint8)
  every = launch.launcher(jax.devices())  # multihost_utils' collectives run over every device
  got = np.asarray(every(multihost_utils.process_allgather, mine)).reshape(-1, limit + 1)
  return [bytes(row[1:1 + int(row[0])]).decode() for row in got]


def gather_to_host(tree):
  """Every process gets the whole of each array of `tree` as numpy (a collective for multi-process arrays)."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  return launch.launcher(tree)(multihost_utils.process_allgather, tree, tiled=True)
