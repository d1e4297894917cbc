"""The StreamRL pipeline: sampler and trainer meshes joined by host queues, in four run modes."""

from streamrl_jax.pipeline.config import MODES, PipelineConfig
from streamrl_jax.pipeline.groups import GroupCollector, samples_to_shard
from streamrl_jax.pipeline.runner import RunResult, run_pipeline

__all__ = ["GroupCollector", "MODES", "PipelineConfig", "RunResult", "run_pipeline", "samples_to_shard"]
