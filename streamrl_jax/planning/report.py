"""A plan in words (`plan_text`: what `streamrl plan` prints) and as one JSON object (`plan_json`: its `--json` line,
the keys `fits`, `trainer_hbm_frac`, `sampler_hbm_frac`, `trainer_step_s`, `decode_step_s`, `samples_per_s`, `split`
first)."""

from __future__ import annotations

from streamrl_jax.models.device_memory import HEADROOM
from streamrl_jax.planning.chips import GIB
from streamrl_jax.planning.measured import PlanCheck
from streamrl_jax.planning.plan import Plan, advice
from streamrl_jax.planning.sides import SidePlan



def plan_json(plan: Plan) -> dict:
  chip = plan.chip
  return dict(fits=plan.fits, trainer_hbm_frac=round(plan.trainer_hbm_frac, 4),
              sampler_hbm_frac=round(plan.sampler_hbm_frac, 4), trainer_step_s=plan.trainer.step_s(chip),
              decode_step_s=plan.sampler.step_s(chip), samples_per_s=round(plan.samples_per_s, 4), split=plan.split,
              advice=None if plan.fits else advice(plan), topology=plan.topology.name, chip=_chip(plan),
              model=dict(spec=plan.request.model, source=plan.model_source, architecture=plan.model.architecture,
                         params=plan.model.param_count(), dtype=plan.model.dtype),
              new_tokens_median=plan.new_tokens, efficiency=plan.request.efficiency, headroom=HEADROOM,
              trainer=plan.trainer.as_dict(chip), sampler=plan.sampler.as_dict(chip), attention=plan.attention,
              split_scores=plan.split_scores)


def plan_text(plan: Plan) -> str:
  chip, split = plan.chip, plan.split
  lines = [f"plan: {plan.request.model} ({plan.model.architecture}, {plan.model.param_count() / 1e9:.2f}B parameters, "
           f"config from {plan.model_source}) on {plan.topology.name}: {plan.topology.devices} x {chip.name} "
           f"({chip.hbm_bytes / GIB:.2f} GiB, {chip.peak_flops / 1e12:.0f} TFLOP/s, "
           f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s)",
           f"split: {split['sampler']} sampler chips ({split['instances']} engine instances of "
           f"{plan.sampler.mesh.get('tensor', 1)}) + {split['trainer']} trainer chips ({split['chosen_by']})"]
  lines += _side(plan.trainer, plan) + _side(plan.sampler, plan)
  if plan.attention:
    a = plan.attention
    lines.append(f"trainer attention, one layer's gradient on a chip ({a['rows']} x {a['length']} tokens): "
                 f"temporaries {a['kernel'] / GIB:.2f} GiB with the kernel, {a['xla'] / GIB:.2f} GiB with XLA's "
                 f"({a['kernel_over_xla']:.3f})")
  lines.append(f"simulator: {plan.samples_per_s:.2f} samples/s at this split (each side at "
               f"{plan.request.efficiency:.0%} of its roofline; completions {plan.new_tokens:.0f} tokens at the "
               "median)")
  lines.append("fits" if plan.fits else advice(plan))
  return "\n".join(lines)


def _side(side: SidePlan, plan: Plan) -> list[str]:
  chip = plan.chip
  head = (f"{side.role}: mesh {side.mesh}, peak {side.peak_bytes / GIB:.2f} GiB a chip = {side.hbm_frac(chip):.1%} of "
          f"{chip.hbm_bytes / GIB:.2f} GiB (held: "
          + ", ".join(f"{k} {v / GIB:.2f}" for k, v in side.held.items()) + ")")
  out = [head]
  for program in side.programs:
    if program.refused:
      out.append(f"  {program.name}: REFUSED by the compiler, it needs {program.temp_bytes / GIB:.1f} GiB of "
                 f"temporaries ({program.refused})")
      continue
    collectives = ", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in program.collective_bytes.items()) or "none"
    out.append(f"  {program.name}: arguments {program.argument_bytes / GIB:.2f} GiB, outputs "
               f"{(program.output_bytes - program.alias_bytes) / GIB:.2f} GiB (beyond donated), temporaries "
               f"{program.temp_bytes / GIB:.2f} GiB, code {program.code_bytes / GIB:.3f} GiB; XLA counts "
               f"{program.xla_flops / 1e12:.2f} TFLOP, {program.xla_bytes / GIB:.1f} GiB; collectives {collectives}; "
               f"{program.kernels} Pallas kernel calls; compiled in {program.compile_s:.0f} s")
  terms = side.step.terms(chip)
  what = ("RL step" if side.role == "trainer" else "decode step")
  extra = (f" ({side.notes['calls_per_step']} calls of {side.notes['call_rows']} x {side.notes['call_length']} "
           f"tokens + the optimizer step)" if side.role == "trainer" else
           f" ({side.notes['slots']} rows at a mean context of {side.notes['context']:.0f})")
  out.append(f"  {what}{extra}: roofline {side.step_s(chip):.4g} s, {side.step.bound(chip)}-bound (compute "
             f"{terms['compute']:.4g} s, memory {terms['memory']:.4g} s, interconnect {terms['ici']:.4g} s)")
  return out


def _chip(plan: Plan) -> dict:
  chip = plan.chip
  return dict(name=chip.name, platform=chip.platform, hbm_bytes=chip.hbm_bytes, peak_flops=chip.peak_flops,
              hbm_bytes_per_s=chip.hbm_bytes_per_s, ici_bytes_per_s=chip.ici_bytes_per_s)


def check_text(check: PlanCheck) -> str:
  """The plan's figures beside the measured ones, a line a side."""
  lines = []
  for side, step in (("trainer", "RL step"), ("sampler", "decode step")):
    planned, measured = getattr(check, f"planned_{side}"), getattr(check, f"measured_{side}")
    lines.append(f"check, {side}: peak {planned.peak_bytes / GIB:.3f} GiB a device planned, "
                 f"{measured.peak_bytes / GIB:.3f} measured ({planned.peak_bytes / measured.peak_bytes:.3f}); {step} "
                 f"{planned.step_s * 1e3:.1f} ms at the roofline, {measured.step_s * 1e3:.1f} ms measured "
                 f"({planned.step_s / measured.step_s:.3f})")
  return "\n".join(lines)
