"""A sampler's samples to the trainer process that trains them: each group to its owner's door
(`step_plan.group_owner`, the doors from `Registered.data_endpoints`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from streamrl_jax.pipeline.step_plan import group_owner
from streamrl_jax.streaming.flight_client import FlightConnection, FlightSampleSender


class RoutedSender:
  """`put(shard)` as `FlightSampleSender.put`, each of the shard's groups to its owner's door: the trainer's server
  (`home`: process 0's door, and every door of a trainer of one process) or another process's, dialled with
  `connect(address)` (with TLS as the trainer's server: the trainer's processes share its certificate)."""

  def __init__(self, home: FlightConnection, connect: Callable[[str], FlightConnection]):
    self.connect = connect
    self.senders = [FlightSampleSender(home, -1)]
    self._earlier: dict = {}  # what the other doors of earlier registrations took

  def start(self, sampler_id: int, endpoints: tuple[str, ...]) -> None:
    """A registration as `sampler_id`: the trainer's doors are `endpoints` ("" or none: the trainer's server)."""
    self.close()
    self.senders[0].sampler_id = sampler_id
    self.senders[1:] = [FlightSampleSender(self.connect(address), sampler_id) for address in endpoints[1:]]

  def doors(self) -> tuple[FlightConnection, ...]:
    """The connections to the trainer's other processes' doors (each also serves its pieces of every version)."""
    return tuple(sender.connection for sender in self.senders[1:])

  def put(self, shard, timeout: float | None = None) -> None:
    owners = np.asarray([group_owner(g, len(self.senders)) for g in shard.group_ids])
    for owner in np.unique(owners):
      part = shard if len(np.unique(owners)) == 1 else shard.take(np.flatnonzero(owners == owner))
      self.senders[int(owner)].put(part, timeout)

  @property
  def stats(self) -> dict:
    """Every door's sends added up, and each door's samples (`put_samples/P`)."""
    total = dict(self._earlier)
    for i, sender in enumerate(self.senders):
      for key, value in sender.stats.items():
        total[key] = total.get(key, 0) + value
      if len(self.senders) > 1:
        total[f"put_samples/{i}"] = total.get(f"put_samples/{i}", 0) + sender.stats["put_samples"]
    return total

  def close(self) -> None:
    """Closes the connections to the other processes' doors (the home connection is its owner's)."""
    for i, sender in enumerate(self.senders[1:], 1):
      for key, value in sender.stats.items():
        self._earlier[key] = self._earlier.get(key, 0) + value
      self._earlier[f"put_samples/{i}"] = self._earlier.get(f"put_samples/{i}", 0) + sender.stats["put_samples"]
      sender.connection.close()
      sender.connection.client.close()
    del self.senders[1:]
