"""The trainer's messages to the controller through the checked codec."""

import pytest

from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import (Ack, Backfill, Backfilled, BadMessage, Published, Regenerate, SamplerWait,
                                   SamplerWaitQuery, StepSummary, StepSummaryRequest, StepTrained)

SUMMARY = StepSummary(2.5, sampler_instances=3, sampler_processes=2, sampler_rss_mb=120.0,
                      ranker={"ranker_spearman": 0.5, "ranker_train_steps": 4})


@pytest.mark.parametrize("message", [
    Published(3), StepTrained(2, 0.75), StepSummaryRequest(2), StepSummaryRequest(2, timeout_s=1.5), SUMMARY,
    Regenerate(2, (8, 9)), Backfill(2, (1,)), Backfilled(1), SamplerWaitQuery(), SamplerWait(0.25), Ack()])
def test_the_trainers_messages_round_trip(message):
  assert decode_message(encode_message(message), type(message)) == message


def test_a_step_summary_is_the_metrics_row_it_always_was():
  assert SUMMARY.metrics() == dict(generation_s=2.5, sampler_instances=3, sampler_processes=2, sampler_rss_mb=120.0,
                                   template_prefix_mismatch=0, ranker_spearman=0.5, ranker_train_steps=4)
  assert list(StepSummary(0.0, 1, 1, 0.0, {}).metrics()) == ["generation_s", "sampler_instances", "sampler_processes",
                                                            "sampler_rss_mb", "template_prefix_mismatch"]


@pytest.mark.parametrize("data, problem", [
    (b'{"@type":"Regenerate","step":1,"group_ids":[-1]}', r"Regenerate.group_ids\[0\] must lie in"),
    (b'{"@type":"StepTrained","step":1,"train_s":"1"}', "StepTrained.train_s must be float"),
    (b'{"@type":"Backfill","step":1}', r"Backfill: missing fields \['filtered'\]"),
    (b'{"@type":"Backfilled","count":1,"extra":0}', "Backfilled: unknown fields"),
])
def test_malformed_trainer_messages_are_refused_by_name(data, problem):
  with pytest.raises(BadMessage, match=problem):
    decode_message(data)
