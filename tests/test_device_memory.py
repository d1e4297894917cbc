"""What a TPU program is compiled to use of its device's memory (`models.device_memory`): the limit by hand, and the
trainer's gradient call and optimizer step compiled by TPU's own compiler (libtpu, no TPU here) within what their
device has left beside them."""

from __future__ import annotations

import json
import re

import pytest

from streamrl_jax.models.compile_target import compiling_for
from streamrl_jax.models.device_memory import HEADROOM, MIB, memory_limit, planned_memory

GIB = 2**30


class _Device:
  """A device that reports its memory as a TPU's runtime does."""

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    if isinstance(self.stats, Exception):
      raise self.stats
    return self.stats


def test_the_limit_by_hand():
  device = _Device({"bytes_limit": 16 * GIB, "bytes_in_use": 5 * GIB})
  with compiling_for("tpu"):
    # 0.9 x 16 GiB less 1 GiB beside, less the 2 GiB in use that are not the owner's 3
    assert memory_limit(device, GIB, resident=3 * GIB) == {"xla_tpu_max_hbm_size_mib": str(int(11.4 * 1024))}
    assert memory_limit(device, GIB, resident=6 * GIB) == {"xla_tpu_max_hbm_size_mib": str(int(13.4 * 1024))}
    with planned_memory(10 * GIB):  # a plan's chip: nothing in use, the device's own figures not read
      assert memory_limit(device, GIB) == {"xla_tpu_max_hbm_size_mib": "8192"}
      with pytest.raises(ValueError, match="leave nothing of the 0.9 x 10.00 GiB"):
        memory_limit(device, 9 * GIB)
    assert memory_limit(_Device(RuntimeError("no statistics")), GIB) == {}
    assert memory_limit(_Device({}), GIB) == {}
  with compiling_for("cpu"), planned_memory(10 * GIB):
    assert memory_limit(device, GIB) == {}  # off a TPU: XLA's own


_AVAILABLE = re.compile(r"available HBM \(([\d.]+)([KMG])\)")


def _available(refusal: str) -> float:
  number, unit = _AVAILABLE.search(refusal).groups()
  return float(number) * {"K": 2**10, "M": 2**20, "G": 2**30}[unit]


@pytest.mark.slow
def test_the_trainers_programs_are_compiled_within_what_their_device_has_left(tmp_path):
  """A tiny Qwen3's trainer on two v5e chips, planned for a chip too small for its gradient call: TPU's compiler
  refuses it naming the memory it was given, which is the chip's at HEADROOM less the optimizer's moments and the
  published copy (the policy in bfloat16); the optimizer step the chip at HEADROOM less the published copy (no frozen
  model here)."""
  from streamrl_jax.commands.plan_inputs import planned_run
  from streamrl_jax.planning.chips import parse_topology
  from streamrl_jax.planning.trainer_plan import plan_trainer
  from tests.test_plan import TINY, TINY_RUN

  (tmp_path / "config.json").write_text(json.dumps(TINY))
  setup, model, _, _ = planned_run([], list(TINY_RUN), str(tmp_path / "config.json"), "tpu")
  topology = parse_topology("v5e:2x2")
  devices = topology.device_list()[2:]
  with compiling_for("tpu"):
    with planned_memory(topology.chip.hbm_bytes):
      roomy = plan_trainer(setup, model, devices, topology.chip, 96)
    accumulate = roomy.programs[0]
    assert not roomy.refused and accumulate.peak_bytes > 0
    published = roomy.held["weights"] // 2  # float32 master weights, published in bfloat16
    beside = roomy.held["optimizer"] + published
    # a chip whose limit is half of what the gradient call took with room
    chip_bytes = (beside + (accumulate.argument_bytes + accumulate.temp_bytes) / 2) / HEADROOM
    with planned_memory(chip_bytes):
      tight = plan_trainer(setup, model, devices, topology.chip, 96)
  refused = tight.programs[0].refused
  assert refused.startswith("RESOURCE_EXHAUSTED"), refused
  assert _available(refused) == pytest.approx(int((HEADROOM * chip_bytes - beside) // MIB) * MIB, rel=0.01)
  # the optimizer step takes the moments (its arguments) and has only the published copy beside it
  assert _available(tight.programs[1].refused) == pytest.approx(int((HEADROOM * chip_bytes - published) // MIB) * MIB,
                                                                rel=0.01)
