"""The StreamRL pipeline: sampler and trainer meshes joined by host queues, in four run modes.

The in-process run is `pipeline.runner` (`run_pipeline`, `RunResult`): it sits above the arms (`arms/`), which sit
above the trainer worker, so this package's own import builds none of them.
"""

from streamrl_jax.pipeline.config import MODES, PipelineConfig
from streamrl_jax.pipeline.sampler.groups import GroupCollector, samples_to_shard

__all__ = ["GroupCollector", "MODES", "PipelineConfig", "samples_to_shard"]
