"""The trainer's data plane: what its processes' links, host copies and process 0 carry per iteration, by design.

A trainer of D devices runs P = ceil(D / devices_per_host) processes, one a host. Two designs
(`SimDataPlaneConfig.design`):

- "central" (today's): every sample batch arrives at process 0's Flight server, which decodes and checks it and
  hands each micro-batch, padded to its longest row, to every process (`distributed.broadcast_shard`:
  `broadcast_one_to_all` is a sum over processes: every device takes the whole micro-batch from its host, all-reduces
  it in a ring with its peers on the other hosts, and each process copies the result back); every version is
  gathered whole onto every device (`process_allgather`, a ring across hosts) and copied from one device to each
  host before process 0 publishes it.
- "per_process": each process receives, decodes and checks only its data-parallel shard's samples, copies only its
  own shards of a version to its host and publishes them (each process sends 1/P of the weight bytes).

Both: the gradient reduction across hosts (a ring over each device's link, each device reducing its
1/devices_per_host slice; within a host NVLink, not modelled) and process 0's control messages per sample. With one
process the two designs are the same. Rates are per direction; seconds are per iteration unless named per shard.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DESIGNS = ("central", "per_process")


@dataclasses.dataclass(frozen=True)
class SimDataPlaneConfig:
  """The trainer's hosts, links and wire formats, and which design moves samples in and versions out."""

  design: str = "per_process"  # today's: each process its own samples and pieces; "central": all through process 0
  devices_per_host: int = 8  # trainer devices per host; one trainer process a host
  nic_gbs: float = 25.0  # each host's front-end NIC for Flight (samples in, weights out), GB/s each way: 200 Gb/s
  fabric_gbs: float = 50.0  # each device's link for collectives across hosts, GB/s: 400 Gb/s InfiniBand a GPU
  host_copy_gbs: float = 25.0  # each device's link to its host, GB/s: PCIe 5 x16 at about 40% of its peak
  hop_latency_s: float = 1e-5  # per step of a ring collective across hosts
  decode_tokens_per_s: float = 2e7  # sample tokens one process decodes and checks a second (batch_to_shard, here)
  wire_bytes_per_token: float = 16.125  # Arrow, streamrl.samples/5: int32 token, f32 logprob, i64 version, 1-bit mask
  wire_bytes_per_sample: float = 100.0  # per row on the wire: list offsets, key, reward, versions, envelope
  broadcast_bytes_per_token: float = 20.0  # central: per padded token, five int32 fields (broadcast_shard's wire)
  grad_bytes_per_param: float = 4.0  # float32 gradients in the reduction across hosts
  control_bytes_per_sample: float = 40.0  # process 0's control messages (lease plan, acknowledgement) per sample

  def __post_init__(self):
    if self.design not in DESIGNS:
      raise ValueError(f"SimDataPlaneConfig.design must be one of {DESIGNS}, got {self.design!r}")
    if self.devices_per_host < 1:
      raise ValueError(f"SimDataPlaneConfig.devices_per_host must be >= 1, got {self.devices_per_host}")
    for name in ("nic_gbs", "fabric_gbs", "host_copy_gbs", "decode_tokens_per_s"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SimDataPlaneConfig.{name} must be > 0, got {getattr(self, name)}")


def processes(plane: SimDataPlaneConfig, devices: int) -> int:
  """Trainer processes (hosts) for `devices` trainer devices."""
  return max(1, -(-devices // plane.devices_per_host))


def leader_share(plane: SimDataPlaneConfig, devices: int) -> float:
  """The share of the samples and of a version's bytes that process 0 carries: all centrally, 1/P per process."""
  return 1.0 if plane.design == "central" else 1.0 / processes(plane, devices)


def sample_wire_bytes(plane: SimDataPlaneConfig, samples: float, tokens: float) -> float:
  return tokens * plane.wire_bytes_per_token + samples * plane.wire_bytes_per_sample


def leader_bytes(plane: SimDataPlaneConfig, samples: float, tokens: float, weight_bytes: float,
                 devices: int) -> dict[str, float]:
  """Bytes through process 0's NIC in one iteration: samples in, a version out, control messages (each way)."""
  share = leader_share(plane, devices)
  return {"samples_in": share * sample_wire_bytes(plane, samples, tokens), "weights_out": share * weight_bytes,
          "control": samples * plane.control_bytes_per_sample}


def leader_seconds(plane: SimDataPlaneConfig, samples: float, tokens: float, weight_bytes: float,
                   devices: int) -> float:
  """Seconds of process 0's busiest resource in one iteration (its NIC in, its NIC out, its decode); its server runs
  beside training, so an iteration takes at least this long."""
  moved = leader_bytes(plane, samples, tokens, weight_bytes, devices)
  nic = plane.nic_gbs * 1e9
  decode = leader_share(plane, devices) * tokens / plane.decode_tokens_per_s
  return max((moved["samples_in"] + moved["control"]) / nic, (moved["weights_out"] + moved["control"]) / nic, decode)


def received_times(plane: SimDataPlaneConfig, arrivals: np.ndarray, tokens: np.ndarray, devices: int,
                   free_from: float = 0.0) -> np.ndarray:
  """When each sample is in and checked on the process that trains it: one queue, first come first served, at the
  slower of process 0's NIC and its decode (central), or P such queues in parallel (per process); the queue is busy
  until `free_from` with earlier samples."""
  share, order = leader_share(plane, devices), np.argsort(arrivals, kind="stable")
  per_token = max(plane.wire_bytes_per_token / (plane.nic_gbs * 1e9), 1 / plane.decode_tokens_per_s)
  cost = share * (tokens[order] * per_token + plane.wire_bytes_per_sample / (plane.nic_gbs * 1e9))
  done = np.cumsum(cost)  # a FIFO server: done_i = max(arrival_i, done_{i-1}) + cost_i
  out = np.empty(len(order))
  out[order] = done + np.maximum(free_from, np.maximum.accumulate(arrivals[order] - (done - cost)))
  return out


def shard_broadcast_seconds(plane: SimDataPlaneConfig, padded_tokens: float, shards: int, devices: int) -> float:
  """Central, several processes: `shards` micro-batches of `padded_tokens` in all, each to every device from its
  host, summed over processes in a ring, and back to each host. Zero otherwise."""
  p = processes(plane, devices)
  if plane.design != "central" or p == 1:
    return 0.0
  size = padded_tokens * plane.broadcast_bytes_per_token
  ring = 2 * (p - 1) / p
  return (size * (2 / (plane.host_copy_gbs * 1e9) + ring / (plane.fabric_gbs * 1e9))
          + shards * 2 * (p - 1) * plane.hop_latency_s)


def gradient_seconds(plane: SimDataPlaneConfig, params: float, devices: int) -> float:
  """The gradient reduction across hosts, once an iteration (both designs): a ring all-reduce over each device's
  link of its 1/devices_per_host slice. Zero for one host."""
  p = processes(plane, devices)
  if p == 1:
    return 0.0
  size = params * plane.grad_bytes_per_param / plane.devices_per_host
  return 2 * (p - 1) / p * size / (plane.fabric_gbs * 1e9) + 2 * (p - 1) * plane.hop_latency_s


def gather_seconds(plane: SimDataPlaneConfig, weight_bytes: float, devices: int) -> float:
  """A version onto the hosts before it is published: central with several processes gathers it whole onto every
  device (a ring across hosts) and copies it from one device to each host; otherwise each process copies only its
  own shards, from all its devices at once."""
  p, local = processes(plane, devices), min(devices, plane.devices_per_host)
  copy = plane.host_copy_gbs * 1e9
  if plane.design == "central" and p > 1:
    across = (p - 1) / p * weight_bytes / (local * plane.fabric_gbs * 1e9) + (p - 1) * plane.hop_latency_s
    return across + weight_bytes / copy
  return weight_bytes / (p * local * copy)


def publish_links(plane: SimDataPlaneConfig, devices: int) -> int:
  """How many trainer links send a version's first copy: process 0's alone, or every process's (1/P each)."""
  return 1 if plane.design == "central" else processes(plane, devices)
