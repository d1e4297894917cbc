"""TensorBoard event files read back as TensorBoard reads them: the TFRecord framing (length, its CRC, the record,
its CRC) of every file in a folder, each record an `Event` of tensorboardX's protocol buffers."""

import struct
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event


def events(folder: Path) -> list[Event]:
  """Every event of every events file under `folder`, file by file in name (start time) order."""
  out = []
  for path in sorted(Path(folder).rglob("events.out.tfevents.*")):
    data, at = path.read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack_from("<Q", data, at)
      record = data[at + 12:at + 12 + length]
      assert len(record) == length, f"{path}: a record cut short at byte {at}"
      out.append(Event.FromString(record))
      at += 12 + length + 4
  return out


def scalar_steps(folder: Path) -> dict[str, list[int]]:
  """{tag: the steps of its scalar values, in the order written}."""
  steps: dict[str, list[int]] = {}
  for event in events(folder):
    for value in event.summary.value:
      steps.setdefault(value.tag, []).append(event.step)
  return steps
