"""Host-side transport between the meshes: typed sample shards, bounded queues, weight sync; across
processes the same records travel over Arrow Flight."""

from streamrl_jax.streaming.queue import QueueClosed, SampleQueue, SampleTransport
from streamrl_jax.streaming.shard import SampleShard
from streamrl_jax.streaming.weights import WeightPublisher, WeightSource, WeightSync

__all__ = ["QueueClosed", "SampleQueue", "SampleShard", "SampleTransport", "WeightPublisher", "WeightSource",
           "WeightSync"]
