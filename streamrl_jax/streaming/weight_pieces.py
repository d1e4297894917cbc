"""A weight version as the pieces each trainer process holds (a trainer of several processes), and their assembly.

Each process publishes the shards of the version's arrays that its own devices hold with `replica_id` 0: every
distinct slice of every array has exactly one such holder across the cluster, so the processes' pieces are
disjoint and cover the version, and no process gathers what it does not hold; an array every process holds whole
is served by one process in turn. A piece travels as a tensor of its own (`NAME@FIRST,INDICES`) in the usual
weight stream (`weight_chunks`), the stream's metadata saying where each piece lies (`PIECES_KEY`: piece ->
[array, the array's shape, the piece's first index on each axis]). A sampler fetches every process's pieces and
assembles whole arrays, checking that every element arrived exactly once.
"""

from __future__ import annotations

import json

import numpy as np

from streamrl_jax.pytrees import flatten_with_names

PIECES_KEY = b"pieces"


class BadPieces(ValueError):
  """Pieces of a weight version that do not add up to its arrays."""


def own_pieces(tree, process: int = 0, processes: int = 1) -> tuple[dict[str, np.ndarray], dict[str, list]]:
  """(this process's pieces of `tree`'s jax arrays by piece name, where each lies); a host copy of each. An array
  every process holds whole (replicated: LoRA's adapters, norms) is served by one process in turn."""
  pieces, where = {}, {}
  for i, (name, array) in enumerate(flatten_with_names(tree).items()):
    if array.sharding.is_fully_replicated:
      shards = array.addressable_shards[:1] if i % processes == process else []
    else:
      shards = [s for s in array.addressable_shards if s.replica_id == 0]
    for shard in shards:
      starts = [int(index.start or 0) for index in shard.index] if array.ndim else []
      piece = f"{name}@{','.join(map(str, starts))}"  # distinct slices: a name no other process gives
      pieces[piece] = np.require(np.asarray(shard.data), requirements="C")
      where[piece] = [name, list(array.shape), starts]
  return pieces, where


def encode_where(where: dict[str, list]) -> bytes:
  return json.dumps(where).encode()


def decode_where(raw: bytes, pieces: dict[str, np.ndarray]) -> dict[str, list]:
  """The pieces' places of a stream, checked against the pieces it carries (names, ranks, bounds)."""
  try:
    where = {str(p): [str(n), [int(d) for d in shape], [int(s) for s in starts]]
             for p, (n, shape, starts) in json.loads(raw).items()}
  except (ValueError, TypeError, AttributeError, RecursionError) as err:
    raise BadPieces(f"a weight stream's pieces do not parse: {str(err)[:200]}") from None
  for piece in pieces:
    if piece not in where:
      raise BadPieces(f"weight piece {piece[:80]} carries no place")
    _, shape, starts = where[piece]
    ends = [s + d for s, d in zip(starts, pieces[piece].shape)]
    if len(starts) != len(shape) or pieces[piece].ndim != len(shape) or any(
        s < 0 or e > d for s, e, d in zip(starts, ends, shape)):
      raise BadPieces(f"weight piece {piece[:80]} of shape {pieces[piece].shape} at {starts} lies outside {shape}")
  return where


def assemble(pieces: dict[str, np.ndarray], where: dict[str, list]) -> dict[str, np.ndarray]:
  """Whole arrays from every process's pieces; `BadPieces` unless each element arrived exactly once."""
  arrays, filled = {}, {}
  for piece, data in pieces.items():
    name, shape, starts = where[piece]
    if name not in arrays:
      arrays[name], filled[name] = np.empty(shape, data.dtype), 0
    elif arrays[name].dtype != data.dtype or list(arrays[name].shape) != shape:
      raise BadPieces(f"pieces of weight {name[:80]} disagree on its dtype or shape")
    arrays[name][tuple(slice(s, s + d) for s, d in zip(starts, data.shape))] = data
    filled[name] += data.size
  for name, array in arrays.items():
    if filled[name] != array.size:
      raise BadPieces(f"weight {name[:80]}: pieces of {filled[name]} elements arrived for {array.size}")
  return arrays
