"""The history rows of a Weights & Biases run file (`run-<id>.wandb`) as an offline run writes it: LevelDB-log
records (32 KiB blocks, 7-byte headers) of wandb's `Record` protocol buffers, after a 7-byte file header."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def _records(data: bytes):
  pos, pending = HEADER, b""
  while pos + HEADER <= len(data):
    left = BLOCK - pos % BLOCK
    if left < HEADER:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
    if kind == 0 and length == 0:
      pos += left
      continue
    pending += data[pos + HEADER:pos + HEADER + length]
    pos += HEADER + length
    if kind in (1, 4):  # FULL, LAST
      yield pending
      pending = b""


def history(run_file: Path) -> list[dict]:
  """Each `run.log` call's items: {key: value}, media as their JSON descriptions."""
  from wandb.proto import wandb_internal_pb2

  rows = []
  for raw in _records(Path(run_file).read_bytes()):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    if record.WhichOneof("record_type") == "history":
      rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
  return rows
