"""Where each sampler fetches a weight version from: the broadcast tree (a pure plan), its drawing, and the
time a pipelined tree takes to put a version on every sampler over given links (the simulator's model).

Rules of `broadcast_tree`, per version, over the samplers in registration order:
- The trainer's site: a tree rooted at the trainer, breadth first, each node (the trainer too) with at most
  `fanout` children. Samplers that serve no relay are placed after those that do, as leaves.
- Every other site: exactly one sampler (its first relay) pulls across from the trainer; the rest of that
  site pull from it, in a tree of the same fan-out. So the link between two sites carries one copy.
With equal links a chain (fan-out 1) is the fastest pipelined broadcast: every link carries one copy once.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class TreeMember:
  sampler_id: int
  site: str = ""
  relays: bool = True  # serves versions to others


def broadcast_tree(members: Sequence[TreeMember], trainer_site: str = "", fanout: int = 1) -> dict[int, int | None]:
  """{sampler id: the sampler id it fetches from, None for the trainer} (rules in the module's docstring)."""
  if fanout < 1:
    raise ValueError(f"fanout must be >= 1, got {fanout}")
  by_site: dict[str, list[TreeMember]] = {}
  for member in members:
    by_site.setdefault(member.site, []).append(member)
  parents: dict[int, int | None] = {}
  for site, group in by_site.items():
    ordered = [m for m in group if m.relays] + [m for m in group if not m.relays]
    if site == trainer_site:
      parents.update(_attach(None, ordered, fanout))
    else:  # one gateway pulls across; its site hangs below it
      gateway = ordered[0]
      parents[gateway.sampler_id] = None
      parents.update(_attach(gateway.sampler_id, ordered[1:], fanout) if gateway.relays
                     else {m.sampler_id: None for m in ordered[1:]})
  return parents


def _attach(root: int | None, members: list[TreeMember], fanout: int) -> dict[int, int | None]:
  """Breadth-first placement under `root`; leaves beyond every relay's room go to `root`."""
  open_nodes, out = deque([[root, fanout]]), {}
  for member in members:
    if not open_nodes:
      out[member.sampler_id] = root
      continue
    node = open_nodes[0]
    out[member.sampler_id] = node[0]
    node[1] -= 1
    if node[1] == 0:
      open_nodes.popleft()
    if member.relays:
      open_nodes.append([member.sampler_id, fanout])
  return out


def children_of(parents: dict[int, int | None]) -> dict[int | None, list[int]]:
  out: dict[int | None, list[int]] = {}
  for child, parent in parents.items():
    out.setdefault(parent, []).append(child)
  return out


def draw_tree(parents: dict[int, int | None], names: dict[int, str], sites: dict[int, str] | None = None,
              root: str = "trainer") -> str:
  """The tree as indented text, one node a line, e.g. `trainer` / `└─ s0 [b]` / `   └─ s1 [b]`."""
  children, lines = children_of(parents), [root]

  def walk(node: int | None, indent: str) -> None:
    kids = children.get(node, [])
    for i, kid in enumerate(kids):
      last = i == len(kids) - 1
      label = names.get(kid, f"{kid:x}") + (f" [{sites[kid]}]" if sites and sites.get(kid) else "")
      lines.append(f"{indent}{'└─' if last else '├─'} {label}")
      walk(kid, indent + ("   " if last else "│  "))
  walk(None, "")
  return "\n".join(lines)


def broadcast_seconds(parents: dict[int, int | None], sites: dict[int, str], *, model_bytes: float,
                      trainer_bps: float, sampler_bps: float, inter_site_bps: float | None = None,
                      trainer_site: str = "", chunk_bytes: float = 32 << 20) -> float:
  """Seconds until every sampler holds a version sent down `parents` in chunks, each node forwarding a chunk
  once it has it. Rates in bytes/s: a node's uplink (the trainer's or a sampler's) is shared by its children,
  a sampler's downlink is `sampler_bps`, and the edges that cross sites share `inter_site_bps`. A node's
  stream runs at the slowest edge on its path, and its last chunk then crosses every other hop."""
  children = children_of(parents)
  def site_of(node):
    return trainer_site if node is None else sites.get(node, "")
  crossing = [c for c, p in parents.items() if site_of(p) != site_of(c)]
  if crossing and inter_site_bps is None:
    raise ValueError("the tree crosses sites: give inter_site_bps")

  def edge_bps(child: int) -> float:
    parent = parents[child]
    rate = min((trainer_bps if parent is None else sampler_bps) / len(children[parent]), sampler_bps)
    return min(rate, inter_site_bps / len(crossing)) if child in crossing else rate

  worst = 0.0
  for node in parents:
    rates, hop = [], node
    while hop is not None:
      rates.append(edge_bps(hop))
      hop = parents[hop]
      if len(rates) > len(parents):
        raise ValueError("the broadcast tree has a cycle")
    chunk = min(chunk_bytes, model_bytes)
    fill = sum(chunk / r for r in rates) - chunk / min(rates)  # the last chunk, through every hop but the slowest
    worst = max(worst, model_bytes / min(rates) + fill)
  return worst
