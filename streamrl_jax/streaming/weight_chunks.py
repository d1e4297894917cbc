"""Weights of one policy version as streams of Arrow record batches, and their reassembly.

A version may travel as several streams in parallel, each carrying a part of the tensors
(`partition_tensors`, a pure function of the tensors' sizes, so every holder of a version cuts it alike).
Each stream's schema metadata carries the version, the whole manifest (every tensor's name, dtype and shape,
in order) and the indices of the tensors this part carries; each batch carries one chunk: (tensor index in
the manifest, byte offset, bytes). A relay can therefore forward any part of a version it is still receiving.
A tensor that fits in one chunk is received without a copy (a read-only view of the Arrow buffer); a larger
one is copied into place. The receiver checks the manifest against the tensors it expects and that every byte
of its part arrived.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pyarrow as pa

SCHEMA_NAME = "streamrl.weights/2"
CHUNK_COLUMNS = [("tensor", pa.int32()), ("offset", pa.int64()), ("data", pa.large_binary())]
DEFAULT_CHUNK_BYTES = 32 << 20  # most tensors fit in one (received without a copy); a relay forwards whole chunks


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


MAX_PARTS = 64  # a weights ticket asks for at most this many parallel streams


def weights_ticket(version: int, part: int = 0, parts: int = 1) -> bytes:
  """The DoGet ticket of part `part` of `parts` of a version (the trainer's and a relay's alike)."""
  return json.dumps({"weights": version, "part": part, "parts": parts}).encode()


def read_weights_ticket(raw: bytes) -> tuple[int, int, int]:
  """(version, part, parts) of a weights ticket; ValueError naming what is wrong."""
  if len(raw) > 1024:
    raise ValueError(f"a ticket of {len(raw)} bytes")
  try:
    request = json.loads(raw)
    version, part, parts = int(request["weights"]), int(request.get("part", 0)), int(request.get("parts", 1))
  except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
    raise ValueError(f"bad weights ticket {raw[:80]!r}: {type(err).__name__} {str(err)[:100]}") from None
  if not 1 <= parts <= MAX_PARTS or not 0 <= part < parts:
    raise ValueError(f"bad weights ticket: part {part} of {parts} (parts: 1 to {MAX_PARTS})")
  return version, part, parts


class BadWeightStream(ValueError):
  """A weight stream whose manifest or chunks do not add up."""


def manifest_of(flat: dict[str, np.ndarray]) -> list:
  """[(name, dtype, shape)] of named arrays, in order."""
  return [(name, jnp.dtype(a.dtype), tuple(a.shape)) for name, a in flat.items()]


def tensor_nbytes(manifest: list) -> list[int]:
  return [int(np.prod(shape)) * jnp.dtype(dtype).itemsize for _, dtype, shape in manifest]


def part_indices(manifest: list, part: int, parts: int) -> list[int]:
  """The tensors of part `part` of `parts` (the same cut on every holder of the version)."""
  return partition_tensors(tensor_nbytes(manifest), parts)[part]


def weight_schema(version: int, manifest: list, part: list[int] | None = None) -> pa.Schema:
  """The schema of a stream carrying the tensors `part` (default: all) of a version's `manifest`."""
  encoded = [[name, np.dtype(dtype).name, list(shape)] for name, dtype, shape in manifest]
  return pa.schema(CHUNK_COLUMNS, metadata={
      "schema": SCHEMA_NAME, "version": str(version), "tensors": json.dumps(encoded),
      "part": json.dumps(list(range(len(manifest))) if part is None else list(part))})


def chunk_batch(schema: pa.Schema, index: int, offset: int, data: pa.Buffer) -> pa.RecordBatch:
  """One chunk as a one-row batch around `data` (no copy of its bytes)."""
  offsets = pa.py_buffer(np.asarray([0, data.size], np.int64))
  column = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, data])
  return pa.record_batch([pa.array([index], pa.int32()), pa.array([offset], pa.int64()), column], schema=schema)


def weight_batches(schema: pa.Schema, arrays: list[np.ndarray], chunk_bytes: int = DEFAULT_CHUNK_BYTES):
  """Yields the chunks of the schema's part of `arrays` (C-contiguous, in manifest order), without copying
  their bytes."""
  for index in json.loads(schema.metadata[b"part"]):
    data = memoryview(np.ascontiguousarray(arrays[index]).reshape(-1).view(np.uint8))
    for offset in range(0, max(len(data), 1), chunk_bytes):
      yield chunk_batch(schema, index, offset, pa.py_buffer(data[offset:offset + chunk_bytes]))


def chunk_rows(batch: pa.RecordBatch) -> Iterator[tuple[int, int, pa.Buffer]]:
  """(tensor index, byte offset, bytes) of each chunk in a batch."""
  if not batch.schema.remove_metadata().equals(pa.schema(CHUNK_COLUMNS)):
    raise BadWeightStream(f"weight chunk columns {batch.schema.names}, expected {[n for n, _ in CHUNK_COLUMNS]}")
  if any(column.null_count for column in batch.columns):
    raise BadWeightStream("a weight chunk with a null field")
  for row, (index, offset) in enumerate(zip(batch.column(0).to_numpy(), batch.column(1).to_numpy())):
    yield int(index), int(offset), batch.column(2)[row].as_buffer()


def read_manifest(schema: pa.Schema) -> tuple[int, list, list[int]]:
  """(version, [(name, dtype, shape)], indices of the tensors this stream carries) of a weight stream."""
  meta = schema.metadata or {}
  if meta.get(b"schema") != SCHEMA_NAME.encode():
    raise BadWeightStream(f"weight stream schema is not {SCHEMA_NAME!r}")
  if not schema.remove_metadata().equals(pa.schema(CHUNK_COLUMNS)):
    raise BadWeightStream(f"weight stream columns {schema.remove_metadata()} are not {pa.schema(CHUNK_COLUMNS)}")
  try:
    manifest = [(str(name), jnp.dtype(dtype), tuple(int(d) for d in shape))
                for name, dtype, shape in json.loads(meta[b"tensors"])]
    part = [int(i) for i in json.loads(meta[b"part"])]
    version = int(meta[b"version"])
  except (KeyError, ValueError, TypeError) as err:
    raise BadWeightStream(f"weight stream metadata does not parse: {str(err)[:200]}") from None
  if any(not 0 <= i < len(manifest) for i in part) or len(set(part)) != len(part):
    raise BadWeightStream(f"weight stream part {part[:8]} is not a set of tensors of its manifest ({len(manifest)})")
  return version, manifest, part


def check_tensors(flat: dict[str, np.ndarray], expected: dict[str, tuple]) -> None:
  """The received tensors must be exactly the expected names ({name: shape}) with those shapes."""
  if set(flat) != set(expected):
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    raise BadWeightStream(f"weights differ from this model's: missing {missing[:3]}, unexpected {extra[:3]}")
  for name, array in flat.items():
    if tuple(expected[name]) != tuple(array.shape):
      raise BadWeightStream(f"weight {name} has shape {tuple(array.shape)}, this model expects {tuple(expected[name])}")


class WeightAssembler:
  """Collects the chunks of one stream (the tensors `part` of `manifest`, default all); `result()` gives
  {name: array} of that part once every byte arrived."""

  def __init__(self, manifest: list, part: list[int] | None = None):
    self.manifest = manifest
    self.part = list(range(len(manifest))) if part is None else list(part)
    self._in_part = set(self.part)
    self._nbytes = tensor_nbytes(manifest)
    self._arrays: dict[int, np.ndarray] = {}
    self._received = dict.fromkeys(self.part, 0)
    self.bytes = 0

  def add(self, batch: pa.RecordBatch) -> None:
    for index, offset, data in chunk_rows(batch):
      self.place(index, offset, data)

  def place(self, index: int, offset: int, data: pa.Buffer) -> None:
    """One chunk: refused unless it lies inside a tensor of this stream's part."""
    if index not in self._in_part:
      raise BadWeightStream(f"chunk of tensor {index}, which this stream's part does not carry "
                            f"({len(self.part)} of {len(self.manifest)} tensors)")
    name, dtype, shape = self.manifest[index]
    total = self._nbytes[index]
    if offset < 0 or offset + data.size > total:
      raise BadWeightStream(f"chunk [{offset}, {offset + data.size}) lies outside weight {name} ({total} bytes)")
    if offset != self._received[index]:  # chunks of a tensor come in order: no gap, no repeat
      raise BadWeightStream(f"chunk at byte {offset} of weight {name}; {self._received[index]} bytes of it had "
                            f"arrived (chunks come in order)")
    if offset == 0 and data.size == total:  # the whole tensor in one chunk: keep the buffer, no copy
      self._arrays[index] = np.frombuffer(data, dtype).reshape(shape)
    else:
      if index not in self._arrays or not self._arrays[index].flags.writeable:
        self._arrays[index] = np.empty(shape, dtype)
      self._arrays[index].reshape(-1).view(np.uint8)[offset:offset + data.size] = np.frombuffer(data, np.uint8)
    self._received[index] += data.size
    self.bytes += data.size

  def result(self) -> dict[str, np.ndarray]:
    for index in self.part:
      name, dtype, shape = self.manifest[index]
      if self._received[index] != self._nbytes[index]:
        raise BadWeightStream(f"weight {name}: {self._received[index]} of {self._nbytes[index]} bytes arrived")
      if index not in self._arrays:  # an empty tensor
        self._arrays[index] = np.empty(shape, dtype)
    return {self.manifest[i][0]: self._arrays[i] for i in self.part}
