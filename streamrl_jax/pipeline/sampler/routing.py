"""A sampler's samples to the trainer process that trains them: each group to its owner's door
(`step_plan.group_owner`, the doors from `Registered.data_endpoints`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from streamrl_jax.pipeline.step_plan import group_owner
from streamrl_jax.streaming.flight_client import FlightConnection, FlightSampleSender


class RoutedSender:
  """`put(shard)` as `FlightSampleSender.put`, each of the shard's groups to its owner's door. `home` sends to the
  trainer's server (process 0's door, and every door for a trainer of one process)."""

  def __init__(self, home: FlightSampleSender, endpoints: tuple[str, ...],
               connect: Callable[[str], FlightConnection]):
    """`connect(address)`: a connection to another process's door (with TLS, as to the trainer's server: the trainer's
    processes share its certificate)."""
    self.senders = [home if not address else FlightSampleSender(connect(address), home.sampler_id)
                    for address in (endpoints or ("",))]

  def put(self, shard, timeout: float | None = None) -> None:
    owners = np.asarray([group_owner(g, len(self.senders)) for g in shard.group_ids])
    for owner in np.unique(owners):
      part = shard if len(np.unique(owners)) == 1 else shard.take(np.flatnonzero(owners == owner))
      self.senders[int(owner)].put(part, timeout)

  @property
  def stats(self) -> dict:
    """The senders' statistics added up, with each door's samples (`put_samples/P`)."""
    total: dict = {}
    for i, sender in enumerate(self.senders):
      for key, value in sender.stats.items():
        total[key] = total.get(key, 0) + value
      total[f"put_samples/{i}"] = sender.stats["put_samples"]
    return total

  def close(self) -> None:
    """Closes the connections to the other processes' doors (the home connection is its owner's)."""
    for sender in self.senders[1:]:
      sender.connection.close()
      sender.connection.client.close()
