"""A run's record across resumes (`pipeline.run_record`): segments, totals and the whole run's timeline, worked by
hand; and the pictures drawn from them."""

import json

from streamrl_jax.records import run_record
from streamrl_jax.records.pictures import curves_figure, write_curves_png, write_timeline_png


def test_a_fresh_start_forgets_an_old_record_and_a_resume_appends_to_it(tmp_path):
  first = run_record.stepped(run_record.begin(tmp_path, None), 3, 12.0)
  run_record.save(tmp_path, first)
  assert json.loads((tmp_path / "run.json").read_text())["segments"] == first
  resumed = run_record.begin(tmp_path, 2)  # the checkpoint of step 2 (step 3 was lost to a kill)
  fresh = dict(first_step=0, last_step=0, seconds=0.0, timeline=None, counters=None)
  assert resumed == first + [dict(fresh, first_step=2, last_step=2)]
  assert run_record.begin(tmp_path, None) == [fresh]
  assert run_record.begin(tmp_path / "old-workdir", 5)[0]["first_step"] == 5  # no record: from this segment on


def test_totals_and_the_whole_timeline_put_segments_end_to_end():
  segments = [dict(first_step=0, last_step=2, seconds=10.0, timeline={"trainer": [(1.0, 4.0, "update 0")],
                                                                       "sync": [(4.0, 4.0, "v1")]},
                   counters=dict(samples_trained=32, trainer_wait_s=1.5, queue_max_depth=4, queue_depth=0,
                                 weight_version_bytes=100, queue_closed=True)),
              dict(first_step=2, last_step=3, seconds=5.0, timeline=None, counters=None),  # killed: its time counts
              dict(first_step=3, last_step=4, seconds=6.0, timeline={"trainer": [(0.5, 7.0, "update 3")],
                                                                       "sampler": [(0.0, 0.5, "step 3")]},
                   counters=dict(samples_trained=16, trainer_wait_s=0.25, queue_max_depth=3, queue_depth=1,
                                 weight_version_bytes=100, queue_closed=False, empty_steps=1))]
  assert run_record.totals(segments) == dict(
      rl_seconds=21.0, resumes=2, counted_segments=2,
      counters=dict(samples_trained=48, trainer_wait_s=1.75, queue_max_depth=4, queue_depth=1, weight_version_bytes=100,
                    queue_closed=False, empty_steps=1))
  whole = run_record.whole_timeline(segments)
  assert whole["trainer"] == [(1.0, 4.0, "update 0"), (15.5, 22.0, "update 3")]
  assert whole["sync"] == [(4.0, 4.0, "v1")] and whole["sampler"] == [(15.0, 15.5, "step 3")]
  assert whole["resume"] == [(10.0, 10.0, "resumed after step 2"), (15.0, 15.0, "resumed after step 3")]
  ended = run_record.ended(segments[:1], {"trainer": []}, {"leases": 2}, 8.0)  # never less than the steps' own time
  assert ended[0]["seconds"] == 10.0 and ended[0]["timeline"] == {"trainer": []} and ended[0]["counters"] == {"leases": 2}


def test_the_record_is_kept_at_each_step_and_at_the_end(tmp_path):
  now = [100.0]
  record = run_record.RunRecord(tmp_path, None, clock=lambda: now[0])
  now[0] = 103.5
  record.step(1)
  on_disk = json.loads((tmp_path / "run.json").read_text())["segments"]
  assert on_disk == [dict(first_step=0, last_step=1, seconds=3.5, timeline=None, counters=None)]
  now[0] = 104.0
  record.end({"trainer": [[0.0, 1.0, "step 0"]]}, {"samples_trained": 8})
  (segment,) = json.loads((tmp_path / "run.json").read_text())["segments"]
  assert segment["seconds"] == 4.0 and segment["counters"] == {"samples_trained": 8}


def test_the_pictures_are_drawn_from_a_record_and_metrics(tmp_path):
  metrics = [dict(step=s, reward_mean=s / 10, loss=0.1 * s, kl=0.0) for s in range(1, 13)]
  write_curves_png(metrics, [(0, 0.2), (12, 0.6)], tmp_path / "curves.png")
  write_curves_png([], [(0, 0.2)], tmp_path / "before.png")  # before the first step: the evaluation alone
  timeline = {"sampler-0": [(0.0, 1.0, "step 0")], "trainer": [(1.0, 2.0, "update 0")], "sync": [(2.0, 2.0, "v1")],
              "resume": [(2.5, 2.5, "resumed after step 1")]}
  write_timeline_png(timeline, tmp_path / "timeline.png")
  for name in ("curves.png", "before.png", "timeline.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_curves_draw_what_their_labels_say_on_whole_steps():
  def drawn(metrics):
    fig = curves_figure(metrics, [(0, 0.2)])
    top, _, bottom = fig.axes
    fig.canvas.draw()
    labels = ([line.get_label() for line in top.get_lines()], [line.get_label() for line in bottom.get_lines()])
    ticks = [t for t in bottom.get_xticks() if bottom.get_xlim()[0] <= t <= bottom.get_xlim()[1]]
    ylabel = bottom.get_ylabel()
    return labels, ticks, ylabel
  two = [dict(step=s, reward_mean=0.5, loss=0.1, kl=0.0, **{"reward/sums": 0.5, "reward/format": 0.2}) for s in (1, 2)]
  (top, bottom), ticks, ylabel = drawn(two)
  assert top == ["reward mean per step", "format", "sums"] and bottom == ["policy loss"] and ylabel == "loss"
  assert ticks and all(float(t).is_integer() for t in ticks)  # no quarter steps on a 2-step run
  one_function = [dict(step=1, reward_mean=0.5, loss=0.1, kl=0.02, **{"reward/sums": 0.5})]
  (top, bottom), _, ylabel = drawn(one_function)
  assert top == ["reward mean per step"] and bottom == ["policy loss", "KL to the reference policy"]
  assert ylabel == "loss / KL"


def test_few_points_are_drawn_as_labelled_points_and_many_as_a_line():
  def drawn(metrics, evaluations):
    fig = curves_figure(metrics, evaluations)
    top, middle, bottom = fig.axes
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker()) for ax in fig.axes for line in ax.get_lines()}
    texts = [t.get_text() for t in middle.texts], [t.get_text() for t in bottom.texts]
    return styles, texts
  two = [dict(step=s, reward_mean=0.5, loss=0.25 * s, kl=0.0) for s in (1, 2)]
  styles, (accuracy, losses) = drawn(two, [(0, 0.2), (2, 0.6)])  # before and after training
  assert styles["held-out accuracy (greedy)"] == ("None", "o") and accuracy == ["0.200", "0.600"]
  assert styles["reward mean per step"] == styles["policy loss"] == ("None", "o") and losses == ["0.25", "0.5"]
  many = [dict(step=s, reward_mean=s / 10, loss=0.1, kl=0.0) for s in range(1, 13)]
  styles, (accuracy, losses) = drawn(many, [(s, s / 12) for s in range(0, 13, 2)])
  assert styles["held-out accuracy (greedy)"] == ("-", "o") and len(accuracy) == 7  # a line, its points labelled
  assert styles["reward mean per step"] == styles["policy loss"] == ("-", "None") and losses == []


def test_each_follower_arms_counters_add_up_over_the_segments_that_ended():
  segments = [dict(first_step=0, last_step=2, seconds=1.0, timeline=None, counters={"samples_trained": 8},
                   arm_counters={"rloo": {"samples_trained": 8, "arm_steps_skipped": 1}}),
              dict(first_step=2, last_step=3, seconds=1.0, timeline=None, counters=None),  # killed: nothing recorded
              dict(first_step=3, last_step=4, seconds=1.0, timeline=None, counters={"samples_trained": 4},
                   arm_counters={"rloo": {"samples_trained": 4, "arm_steps_skipped": 0}, "dr": {"samples_trained": 4}})]
  assert run_record.arm_totals(segments) == {"dr": {"samples_trained": 4},
                                             "rloo": {"samples_trained": 12, "arm_steps_skipped": 1}}
  assert run_record.arm_totals(segments[1:2]) == {}
  ended = run_record.ended(segments[:1], {}, {"samples_trained": 8}, 1.0, {"rloo": {"samples_trained": 8}})
  assert ended[0]["arm_counters"] == {"rloo": {"samples_trained": 8}}
  assert "arm_counters" not in run_record.ended(segments[1:2], {}, {}, 1.0)[0]  # a run without arms
