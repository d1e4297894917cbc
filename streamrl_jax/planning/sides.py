"""What a plan learns of one side of a run (`SidePlan`): its mesh, its compiled programs on one device, what the
device holds between them, its peak, and its step's work and roofline."""

from __future__ import annotations

import dataclasses

from streamrl_jax.planning.chips import Chip
from streamrl_jax.planning.compiled import ProgramCost
from streamrl_jax.planning.roofline import Work


@dataclasses.dataclass(frozen=True)
class SidePlan:
  """One side (the trainer, or one sampler engine instance) on one device of its mesh."""

  role: str  # "trainer" or "sampler"
  mesh: dict  # axis -> size
  programs: tuple[ProgramCost, ...]
  held: dict  # what a device holds between programs: name -> bytes
  peaks: dict  # program name -> bytes the device holds while it runs (its own and what is held beside it)
  step: Work  # the side's step on one device (the trainer's RL step; one decode step)
  notes: dict  # what the step is made of (calls a step, rows a call, ...)

  @property
  def peak_bytes(self) -> int:
    return max(self.peaks.values())

  @property
  def refused(self) -> bool:
    """Whether the compiler refused one of its programs for want of memory."""
    return any(p.refused for p in self.programs)

  def hbm_frac(self, chip: Chip) -> float:
    return self.peak_bytes / chip.hbm_bytes

  def step_s(self, chip: Chip) -> float:
    return self.step.seconds(chip)

  def as_dict(self, chip: Chip) -> dict:
    return dict(role=self.role, mesh=self.mesh, peak_bytes=self.peak_bytes, hbm_frac=round(self.hbm_frac(chip), 4),
                held=self.held, peaks=self.peaks, programs=[p.as_dict() for p in self.programs],
                step=dict(flops=self.step.flops, hbm_bytes=self.step.hbm_bytes, ici_bytes=self.step.ici_bytes,
                          seconds=self.step_s(chip), bound=self.step.bound(chip),
                          terms=self.step.terms(chip)), notes=self.notes)


def peaks_of(programs: dict, held: dict, arguments: dict) -> dict:
  """Each program's peak on a device: its own (arguments, outputs, temporaries, code) and what is held beside it
  that is not among its arguments (`arguments`: program -> the names of `held` it takes). A program the compiler
  refused reports its temporaries alone: everything held is added to them."""
  return {name: cost.peak_bytes + sum(b for item, b in held.items() if cost.refused or item not in arguments[name])
          for name, cost in programs.items()}
