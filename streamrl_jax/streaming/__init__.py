"""Host-side transport between the meshes: typed sample shards, bounded queues, weight sync."""

from streamrl_jax.streaming.queue import QueueClosed, SampleQueue, SampleTransport
from streamrl_jax.streaming.shard import SampleShard, decode_shard, encode_shard
from streamrl_jax.streaming.weights import WeightSync

__all__ = ["QueueClosed", "SampleQueue", "SampleShard", "SampleTransport", "decode_shard", "encode_shard", "WeightSync"]
