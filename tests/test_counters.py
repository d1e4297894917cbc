"""Typed counters: a misspelt counter fails where it is written; rows read them as mappings of numbers."""

import dataclasses
import importlib
import json
import pkgutil
import sys

import pytest

import streamrl_jax
from streamrl_jax.counters import Counters
from streamrl_jax.sampling.streaming_sampler import SamplerCounters


def test_a_counter_is_written_by_name_and_read_as_a_mapping():
  counters = SamplerCounters()
  counters.finished += 2
  counters.add("decode_calls", 3)
  assert counters["finished"] == 2 and dict(counters)["decode_calls"] == 3
  assert counters == {**dict(counters)} and dict(counters) == counters
  assert json.loads(json.dumps({"sampler_" + k: v for k, v in counters.items()}))["sampler_finished"] == 2
  with pytest.raises(AttributeError):
    counters.finshed = 1  # a misspelt name is refused where it is written
  with pytest.raises(KeyError, match="SamplerCounters counts no 'finshed'"):
    counters.add("finshed")
  counters.reset()
  assert set(counters.values()) == {0}


def _subclasses(cls):
  """The subclasses a module holds (`dataclass(slots=True)` leaves the class it replaced among them until collected)."""
  for sub in cls.__subclasses__():
    if getattr(sys.modules[sub.__module__], sub.__qualname__, None) is sub:
      yield sub
    yield from _subclasses(sub)


def test_every_part_declares_its_counters_as_numbers_with_a_start():
  for module in pkgutil.walk_packages(streamrl_jax.__path__, "streamrl_jax."):
    if module.name.endswith(("counters", "logs")) or "colab" in module.name:
      continue
    importlib.import_module(module.name)
  parts = list(_subclasses(Counters))
  assert len(parts) >= 15
  names = {}
  for part in parts:
    fresh = part()
    assert not hasattr(fresh, "__dict__"), f"{part.__name__} takes any attribute: declare it with slots=True"
    for field in dataclasses.fields(part):
      assert isinstance(fresh[field.name], (int, float)), (part.__name__, field.name)
      names.setdefault(field.name, []).append(part.__name__)
  # one name per metric: a name two parts count is merged into one row only where the parts agree on it
  shared = {n: p for n, p in names.items() if len(p) > 1}
  assert set(shared) <= {"preempted", "tool_calls", "groups_regenerated"}, shared
