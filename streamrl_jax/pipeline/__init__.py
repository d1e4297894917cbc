"""The StreamRL pipeline: sampler and trainer meshes joined by host queues, in four run modes.

`run_pipeline` and `RunResult` are loaded on first use (PEP 562), so that importing one part of the pipeline
(a worker, the controller) does not build the whole in-process run, which imports the arms that import those parts.
"""

from streamrl_jax.pipeline.config import MODES, PipelineConfig
from streamrl_jax.pipeline.sampler.groups import GroupCollector, samples_to_shard

__all__ = ["GroupCollector", "MODES", "PipelineConfig", "RunResult", "run_pipeline", "samples_to_shard"]


def __getattr__(name: str):
  if name in ("RunResult", "run_pipeline"):
    from streamrl_jax.pipeline import runner

    return getattr(runner, name)
  raise AttributeError(f"module 'streamrl_jax.pipeline' has no attribute {name!r}")
