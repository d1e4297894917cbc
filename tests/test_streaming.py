"""Sample shards, the bounded queue and weight sync between meshes."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig, Transformer, shard_model
from streamrl_jax.models.precision import SamplerPrecision, landing
from streamrl_jax.streaming import QueueClosed, SampleQueue, SampleShard, WeightSync


def shard(n: int, length: int = 6, version: int = 0) -> SampleShard:
  rng = np.random.default_rng(n)
  valid = np.arange(length)[None] < rng.integers(3, length + 1, n)[:, None]
  return SampleShard(tokens=rng.integers(0, 50, (n, length)), valid=valid, loss_mask=valid & (np.arange(length) >= 2),
                     logprobs=rng.normal(size=(n, length)), rewards=rng.random(n), 
                     group_ids=np.arange(n) // 2, sample_indices=np.arange(n) % 2, steps=np.zeros(n, int),
                     first_versions=np.full(n, version), last_versions=np.full(n, version))


def test_shard_validation_and_concat():
  with pytest.raises(ValueError, match="rewards has shape"):
    SampleShard(**{**shard(3).__dict__, "rewards": np.zeros(2)})
  both = SampleShard.concat([shard(2, length=4), shard(3, length=6)])
  assert both.tokens.shape == (5, 6) and not both.valid[:2, 4:].any()


def test_queue_backpressure_counts_and_close():
  queue = SampleQueue(capacity=4)
  queue.put(shard(3))
  with pytest.raises(TimeoutError, match="full"):
    queue.put(shard(2), timeout=0.05)  # refused, not dropped: the caller still holds it
  threading.Timer(0.1, queue.get).start()
  queue.put(shard(2), timeout=5)  # unblocks once the consumer takes the first shard
  stats = queue.stats()
  assert (stats["put_shards"], stats["put_samples"], stats["got_samples"], stats["depth"]) == (2, 5, 3, 2)
  assert stats["put_wait_s"] > 0.05
  queue.close()
  assert queue.get().num_samples == 2  # drains after close
  with pytest.raises(QueueClosed):
    queue.get(timeout=1)
  with pytest.raises(QueueClosed):
    queue.put(shard(1))
  with pytest.raises(ValueError, match="can never fit"):
    SampleQueue(2).put(shard(3))


def test_producer_consumer_lose_nothing():
  queue = SampleQueue(capacity=8)
  sent = [shard(n % 4 + 1) for n in range(30)]

  def produce():
    for s in sent:
      queue.put(s, timeout=10)
    queue.close()
  threading.Thread(target=produce).start()
  got = []
  while True:
    try:
      got.append(queue.get(timeout=10))
    except QueueClosed:
      break
  assert [s.num_samples for s in got] == [s.num_samples for s in sent]
  assert queue.stats()["max_depth"] <= 8


def test_weight_sync_moves_versions_to_the_sampler_mesh():
  config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
  trainer_mesh = mesh_from_devices(jax.devices()[4:8], MeshShape(1, 4, 1))
  sampler_mesh = mesh_from_devices(jax.devices()[:4], MeshShape(4, 1, 1))
  _, params = nnx.split(shard_model(Transformer(config, rngs=nnx.Rngs(0)), trainer_mesh))
  precision = SamplerPrecision("bfloat16")
  sync = WeightSync(landing(params, precision, sampler_mesh), precision)
  assert sync.latest() is None
  with pytest.raises(TimeoutError, match="version 1"):
    sync.wait_for(1, timeout=0.05)
  sync.publish(params, version=1)
  assert sync.wait_for(1, timeout=30).version >= 1
  doubled = jax.tree.map(lambda x: x * 2, params)
  sync.publish(doubled, version=2)
  sync.wait()
  placed, version = sync.latest().params, sync.latest().version
  assert version == 2 and set(sync.seconds) == {1, 2}
  leaf = placed["layers"][0]["mlp"]["up_proj"][...]
  assert leaf.dtype == jnp.bfloat16 and set(leaf.sharding.device_set) == set(jax.devices()[:4])
  np.testing.assert_allclose(np.asarray(leaf, np.float32),
                             np.asarray(doubled["layers"][0]["mlp"]["up_proj"][...]), rtol=1e-2)
