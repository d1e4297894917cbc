"""The four run modes by name, and what each means as flags (`ModeSpec`); the pipeline and the simulator
read the flags, never the names."""

from __future__ import annotations

import dataclasses

MODES = ("colocated", "disaggregated", "stream", "async")


@dataclasses.dataclass(frozen=True)
class ModeSpec:
  """What a run mode means, as flags: the code reads these, never the mode's name.

  shared_mesh    sampler and trainer time-share one mesh
  streamed       the trainer accumulates each group as it arrives (dynamic-batch pipelining)
  max_lag        generation of step j needs weights of version >= j - max_lag (0: on-policy)
  mid_step_swap  the sampler picks up newer weights between decode steps
  """

  shared_mesh: bool
  streamed: bool
  max_lag: int
  mid_step_swap: bool

  @classmethod
  def of(cls, mode: str, staleness: int) -> ModeSpec:
    return {"colocated": cls(True, False, 0, False), "disaggregated": cls(False, False, 0, False),
            "stream": cls(False, True, 0, False), "async": cls(False, True, staleness, True)}[mode]
