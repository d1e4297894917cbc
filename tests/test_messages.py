"""The trainer's messages to the controller, and a sampler's rollouts, through the checked codec."""

import numpy as np
import pytest

from streamrl_jax.message_codec import decode_message, encode_message
from streamrl_jax.messages import (Ack, Backfill, Backfilled, BadMessage, Published, Regenerate, SamplerWait,
                                   SamplerWaitQuery, StepSummary, StepSummaryRequest, StepTrained)
from streamrl_jax.types import Rollout, Sample

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


# ---- a sampler's rollouts (handed over as it leaves) ------------------------------------------------------------
@pytest.mark.parametrize("rollout", [
    Rollout(3, 1, (5, 6), (-0.5, -1.0), (2, 3)),  # no loss mask (None): every token the model's
    Rollout(3, 1, (5, 6, 7), (-0.5, 0.0, -1.0), (2, 2, 3), loss_mask=(True, False, True), finished=True),
    Rollout(3, 1, (), (), ())])
def test_a_rollout_round_trips_with_or_without_its_loss_mask(rollout):
  back = decode_message(encode_message(rollout), Rollout)
  assert back == rollout and back.loss_mask == rollout.loss_mask


def test_a_sample_handed_over_as_a_rollout_comes_back_the_same():
  mask = np.asarray([True, False, True])
  for loss_mask in (None, mask):
    sample = Sample(request_id=4, group_id=3, sample_index=1, prompt_tokens=np.asarray([1, 2], np.int32),
                    completion_tokens=np.asarray([5, 6, 7], np.int32),
                    logprobs=np.asarray([-0.5, 0.0, -1.0], np.float32), versions=np.asarray([2, 2, 3], np.int64),
                    finish_reason="stop", first_version=2, last_version=3, loss_mask=loss_mask)
    rollout = decode_message(encode_message(sample.rollout()), Rollout)
    assert rollout.loss_mask == (None if loss_mask is None else (True, False, True))
    back = Sample.of_rollout(rollout, [1, 2], stop_ids=(7,))
    np.testing.assert_array_equal(back.completion_tokens, sample.completion_tokens)
    np.testing.assert_array_equal(back.logprobs, sample.logprobs)
    assert back.versions.dtype == np.int64 and back.versions.tolist() == [2, 2, 3]
    if loss_mask is None:
      assert back.loss_mask is None
    else:
      assert back.loss_mask.tolist() == mask.tolist()
    assert back.finish_reason == "stop" and (back.first_version, back.last_version) == (2, 3)


ROLLOUT = '"@type":"Rollout","group_id":1,"sample_index":0,"logprobs":[-1.0],"versions":[0]'


@pytest.mark.parametrize("data, problem", [
    ('{%s,"completion_tokens":[5],"loss_mask":[]}' % ROLLOUT, "Rollout: .*0 loss-mask entries for 1 completion"),
    ('{%s,"completion_tokens":[5],"loss_mask":[1]}' % ROLLOUT, r"Rollout.loss_mask\[0\] must be bool"),
    ('{%s,"completion_tokens":null}' % ROLLOUT, "Rollout.completion_tokens must be a list"),
    ('{%s,"completion_tokens":[-1]}' % ROLLOUT, r"Rollout.completion_tokens\[0\] must lie in"),
    ('{%s,"tokens":[5]}' % ROLLOUT, r"Rollout: unknown fields \['tokens'\]"),
])
def test_malformed_rollouts_are_refused_by_name(data, problem):
  with pytest.raises(BadMessage, match=problem):
    decode_message(data.encode())
