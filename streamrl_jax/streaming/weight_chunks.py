"""Weights of one policy version as a stream of Arrow record batches, and their reassembly.

The schema's metadata carries the version and the manifest (every tensor's name, dtype and shape, in
order); each batch carries one chunk: (tensor index, byte offset, bytes). A tensor that fits in one chunk
is received without a copy (a read-only view of the Arrow buffer); a larger one is copied into place.
The receiver checks the manifest against the tensors it expects and that every byte arrived. A version may
travel as several streams in parallel, each holding a part of the tensors (`partition_tensors`).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pyarrow as pa

SCHEMA_NAME = "streamrl.weights/1"
CHUNK_COLUMNS = [("tensor", pa.int32()), ("offset", pa.int64()), ("data", pa.large_binary())]
DEFAULT_CHUNK_BYTES = 32 << 20  # larger gRPC messages were slower on loopback; most tensors fit in one


def partition_tensors(nbytes: list[int], parts: int) -> list[list[int]]:
  """Tensor indices per part, the largest first onto the lightest part (LPT), each part in index order."""
  if parts < 1:
    raise ValueError(f"parts must be >= 1, got {parts}")
  loads, out = [0] * parts, [[] for _ in range(parts)]
  for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
    lightest = loads.index(min(loads))
    out[lightest].append(index)
    loads[lightest] += nbytes[index]
  return [sorted(part) for part in out]


class BadWeightStream(ValueError):
  """A weight stream whose manifest or chunks do not add up."""


def weight_schema(version: int, flat: dict[str, np.ndarray]) -> pa.Schema:
  manifest = [[name, np.dtype(a.dtype).name, list(a.shape)] for name, a in flat.items()]
  return pa.schema(CHUNK_COLUMNS, metadata={"schema": SCHEMA_NAME, "version": str(version),
                                            "tensors": json.dumps(manifest)})


def weight_batches(schema: pa.Schema, flat: dict[str, np.ndarray], chunk_bytes: int = DEFAULT_CHUNK_BYTES):
  """Yields the chunks of `flat` (C-contiguous numpy arrays), without copying their bytes."""
  for index, array in enumerate(flat.values()):
    data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    for offset in range(0, max(len(data), 1), chunk_bytes):
      part = pa.py_buffer(data[offset:offset + chunk_bytes])
      offsets = pa.py_buffer(np.asarray([0, part.size], np.int64))
      column = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, part])
      yield pa.record_batch([pa.array([index], pa.int32()), pa.array([offset], pa.int64()), column], schema=schema)


def read_manifest(schema: pa.Schema) -> tuple[int, list]:
  """(version, [(name, dtype, shape)]) of a weight stream."""
  meta = schema.metadata or {}
  if meta.get(b"schema") != SCHEMA_NAME.encode():
    raise BadWeightStream(f"weight stream schema is not {SCHEMA_NAME!r}")
  manifest = [(name, jnp.dtype(dtype), tuple(shape)) for name, dtype, shape in json.loads(meta[b"tensors"])]
  return int(meta[b"version"]), manifest


def check_tensors(flat: dict[str, np.ndarray], expected: dict[str, tuple]) -> None:
  """The received tensors must be exactly the expected names ({name: shape}) with those shapes."""
  if set(flat) != set(expected):
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    raise BadWeightStream(f"weights differ from this model's: missing {missing[:3]}, unexpected {extra[:3]}")
  for name, array in flat.items():
    if tuple(expected[name]) != tuple(array.shape):
      raise BadWeightStream(f"weight {name} has shape {tuple(array.shape)}, this model expects {tuple(expected[name])}")


class WeightAssembler:
  """Collects the chunks of one stream; `result()` gives {name: array} once every byte arrived."""

  def __init__(self, manifest: list):
    self.manifest = manifest
    self._arrays: list[np.ndarray | None] = [None] * len(manifest)
    self._received = [0] * len(manifest)
    self.bytes = 0

  def _nbytes(self, index: int) -> int:
    _, dtype, shape = self.manifest[index]
    return int(np.prod(shape)) * dtype.itemsize

  def add(self, batch: pa.RecordBatch) -> None:
    for index, offset, column_chunk in zip(batch.column(0).to_numpy(), batch.column(1).to_numpy(),
                                           range(batch.num_rows)):
      if not 0 <= index < len(self.manifest):
        raise BadWeightStream(f"chunk of tensor {index}; the manifest has {len(self.manifest)}")
      data = batch.column(2)[column_chunk].as_buffer()
      self._place(int(index), int(offset), data)

  def _place(self, index: int, offset: int, data: pa.Buffer) -> None:
    name, dtype, shape = self.manifest[index]
    total = self._nbytes(index)
    if offset < 0 or offset + data.size > total:
      raise BadWeightStream(f"chunk [{offset}, {offset + data.size}) lies outside weight {name} ({total} bytes)")
    if offset == 0 and data.size == total:  # the whole tensor in one chunk: keep the buffer, no copy
      self._arrays[index] = np.frombuffer(data, dtype).reshape(shape)
    else:
      if self._arrays[index] is None:
        self._arrays[index] = np.empty(shape, dtype)
      self._arrays[index].reshape(-1).view(np.uint8)[offset:offset + data.size] = np.frombuffer(data, np.uint8)
    self._received[index] += data.size
    self.bytes += data.size

  def result(self) -> dict[str, np.ndarray]:
    for index, (name, _, shape) in enumerate(self.manifest):
      if self._received[index] != self._nbytes(index):
        raise BadWeightStream(f"weight {name}: {self._received[index]} of {self._nbytes(index)} bytes arrived")
      if self._arrays[index] is None:  # an empty tensor
        self._arrays[index] = np.empty(shape, self.manifest[index][1])
    return {name: array for (name, _, _), array in zip(self.manifest, self._arrays)}
