"""Which sampler fetches a weight version from where: per version, a broadcast tree (`scheduling.broadcast`) of
the samplers registered at the version's first query, the trainer at its root. The newest 4 versions' trees
are kept; a tree with relays at work is put in the timeline (a `broadcast_tree` event, drawn)."""

from __future__ import annotations

from collections.abc import Sequence

from streamrl_jax.pipeline.controller.roster import Member
from streamrl_jax.pipeline.controller.timeline import Timeline
from streamrl_jax.scheduling.broadcast import TreeMember, broadcast_tree, draw_tree

KEPT_TREES = 4


class WeightTrees:
  """Trees by version for a trainer at `site`, `fanout` children per node."""

  def __init__(self, timeline: Timeline, *, site: str = "", fanout: int = 1):
    self.site, self.fanout, self._timeline = site, fanout, timeline
    self._trees: dict[int, dict[int, int | None]] = {}  # version -> {sampler id: parent id, None: the trainer}

  def __contains__(self, version: int) -> bool:
    return version in self._trees

  def plant(self, version: int, members: Sequence[Member]) -> None:
    """The tree of `version` over `members`; trees older than the newest `KEPT_TREES` are dropped."""
    previous = self._trees[max(self._trees)] if self._trees else None
    tree = broadcast_tree([TreeMember(m.sampler_id, m.site, bool(m.relay)) for m in members], self.site, self.fanout)
    self._trees[version] = tree
    for old in sorted(self._trees)[:-KEPT_TREES]:
      del self._trees[old]
    if any(parent is not None for parent in tree.values()):  # relays at work: the timeline shows the tree
      names = {m.sampler_id: m.name for m in members}
      sites = {m.sampler_id: m.site for m in members}
      self._timeline.event("broadcast_tree", version=version,
                           parents={names[c]: names.get(p) for c, p in tree.items()},
                           drawing=draw_tree(tree, {i: names[i] for i in tree}, {i: sites[i] for i in tree}),
                           unchanged=tree == previous)

  def parent(self, version: int, sampler_id: int) -> int | None:
    """The sampler `sampler_id` fetches `version` from (None: the trainer, also when not in the tree)."""
    return self._trees[version].get(sampler_id)
