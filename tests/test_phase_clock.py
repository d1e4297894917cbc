"""Where a step's seconds go: the phase clock against hand-worked timelines and a property (the phases of a take
add up to the wall time between takes), and a run's rows (each side's seconds add up to its wall)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import SAMPLER_PHASES, BadMessage, StepReport, StepSummary
from streamrl_jax.phase_clock import PhaseClock, accounted_frac
from streamrl_jax.pipeline.trainer.worker import TRAINER_PHASES


class FakeTime:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_nested_phases_keep_their_own_seconds_and_the_rest_is_other():
  t = FakeTime()
  clock = PhaseClock(("host", "decode"), clock=t)
  t.now = 1.0  # 1 s in no phase
  with clock.phase("host"):
    t.now = 3.0  # 2 s of host
    with clock.phase("decode"):
      t.now = 7.0  # 4 s of decode, not host's
    t.now = 7.5  # 0.5 s more host
  t.now = 8.0  # 0.5 s in no phase
  assert clock.take() == {"host": 2.5, "decode": 4.0, "other": 1.5}
  t.now = 9.0
  assert clock.take() == {"host": 0.0, "decode": 0.0, "other": 1.0}  # a take starts the next count from zero


def test_a_take_inside_a_phase_charges_it_so_far_and_the_rest_goes_to_the_next_take():
  t = FakeTime()
  clock = PhaseClock(("report",), clock=t)
  with clock.phase("report"):
    t.now = 2.0
    assert clock.take() == {"report": 2.0, "other": 0.0}
    t.now = 3.0
  assert clock.take() == {"report": 1.0, "other": 0.0}


def test_unknown_and_reserved_phase_names_are_refused():
  with pytest.raises(ValueError, match="not 'other'"):
    PhaseClock(("other",))
  clock = PhaseClock(("host",))
  with pytest.raises(ValueError, match="unknown phase 'decode'"):
    with clock.phase("decode"):
      pass


@given(st.lists(st.tuples(st.sampled_from(["enter_a", "enter_b", "exit", "tick", "take"]),
                          st.floats(0.0, 10.0, allow_nan=False)), max_size=40))
def test_the_phases_of_a_take_add_up_to_the_wall_time_between_takes(events):
  t = FakeTime()
  clock = PhaseClock(("a", "b"), clock=t)
  open_phases, last_take = [], 0.0
  for kind, dt in events:
    t.now += dt
    if kind.startswith("enter"):
      cm = clock.phase(kind[-1])
      cm.__enter__()
      open_phases.append(cm)
    elif kind == "exit" and open_phases:
      open_phases.pop().__exit__(None, None, None)
    elif kind == "take":
      taken = clock.take()
      assert sum(taken.values()) == pytest.approx(t.now - last_take) and min(taken.values()) >= 0
      last_take = t.now
  assert sum(clock.take().values()) == pytest.approx(t.now - last_take)


def test_accounted_frac_is_the_share_outside_other():
  assert accounted_frac({"a": 3.0, "other": 1.0}) == 0.75
  assert accounted_frac({"a": 0.0, "other": 0.0}) == 1.0


def test_a_report_carries_every_sampler_phase_or_none():
  seconds = tuple(float(i) for i in range(len(SAMPLER_PHASES) + 1))
  report = StepReport(sampler_id=1, lease_id=2, step=0, generation_s=1.0, lengths=(3.0,), wait_s=0.0, samples=4,
                      instances=1, busy=((0.0, 1.0),), phase_s=seconds)
  assert decode_message(encode_message(report)) == report
  short = json.loads(encode_message(report))
  short["phase_s"] = [1.0, 2.0]
  with pytest.raises(BadMessage, match=f"phase_s holds 2 values; it needs {len(SAMPLER_PHASES) + 1}"):
    decode_message(json.dumps(short).encode())
  summary = StepSummary(generation_s=1.0, sampler_instances=1, sampler_processes=1, sampler_rss_mb=0.0, ranker={},
                        phase_s=seconds)
  row = summary.metrics()
  assert [row[f"sampler_s/{p}"] for p in (*SAMPLER_PHASES, "other")] == list(seconds)
  assert row["sampler_accounted_frac"] == pytest.approx(1 - seconds[-1] / sum(seconds))


@pytest.mark.slow
def test_a_runs_rows_account_for_each_sides_seconds(tmp_path):
  """A demo run: each row's trainer seconds add up to the gap since the previous row (the first: since the start
  of RL), and the samplers' add up to their reports' wall time; what the phases name covers nearly all of it."""
  from tests.processes import finish, train, write_config

  workdir = tmp_path / "run"
  code, out = finish(train(workdir, "--config", write_config(tmp_path / "tiny.gin", steps=4, mode="async")), workdir)
  assert code == 0, out[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 4
  for row in rows:
    trainer = [row[f"trainer_s/{p}"] for p in (*TRAINER_PHASES, "other")]
    sampler = [row[f"sampler_s/{p}"] for p in (*SAMPLER_PHASES, "other")]
    assert min(trainer + sampler) >= 0
    assert row["trainer_accounted_frac"] == pytest.approx(1 - row["trainer_s/other"] / sum(trainer))
    assert row["trainer_s/forward_backward"] > 0 and row["sampler_s/decode"] + row["sampler_s/host"] > 0
  gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]  # rows written one wall step apart
  walls = [sum(r[f"trainer_s/{p}"] for p in (*TRAINER_PHASES, "other")) for r in rows[1:]]
  assert walls == pytest.approx(gaps, abs=0.05)
  assert sum(r["trainer_s/checkpoint"] for r in rows[1:]) > 0  # a step's checkpoint is in the next row
