"""Served text and agent transcripts without a server: a choice's text under stop strings and streaming, request
fields checked one by one, and an episode's transcript built from the sampled ids, never a re-tokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.models.tokenizer import CharTokenizer
from streamrl_jax.serving.episodes import Episodes
from streamrl_jax.serving.protocol import ApiError, parse_call
from streamrl_jax.serving.text_stream import ChoiceText, held_back

TOK = CharTokenizer()


def _choice(stops=()):
  return ChoiceText(TOK.decode, stops, TOK.stop_ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab=;<>", min_size=1, max_size=30), stops=st.lists(
    st.text(alphabet="ab=;<>", min_size=1, max_size=3), max_size=2), cuts=st.lists(st.integers(1, 5), max_size=30))
def test_streamed_pieces_join_to_the_text_cut_before_the_first_stop_string(text, stops, cuts):
  choice, pieces, ids, at = _choice(tuple(stops)), [], TOK.encode(text), 0
  for size in cuts + [len(ids)]:
    piece, at = ids[at:at + size], at + size
    if choice.add(piece, [0.0] * len(piece), [0] * len(piece)):
      break
    pieces.append(choice.sendable())
  choice.finish("length", ids, [0.0] * len(ids), [0] * len(ids))
  pieces.append(choice.sendable())
  # as generation sees it, token by token: the first prefix that holds a stop string ends the choice there
  ends = [k for k in range(1, len(text) + 1) if any(stop in text[:k] for stop in stops)]
  if ends:
    k = ends[0]
    expected = text[:min(text[:k].find(stop) for stop in stops if stop in text[:k])]
  else:
    k, expected = len(text), text
  assert "".join(pieces) == choice.text == expected
  assert choice.finish_reason == ("stop" if ends else "length")
  assert len(choice.tokens) == k  # its tokens end with the one that completed the stop string


def test_held_back_is_the_longest_end_that_starts_a_stop():
  assert held_back("abc<", ("<call>",)) == 1
  assert held_back("abc<ca", ("<call>", "a")) == 3
  assert held_back("abc", ("<call>",)) == 0


def test_a_stop_token_ends_the_choice_and_is_left_out_of_its_text():
  choice = _choice()
  choice.finish("stop", TOK.encode("12") + [TOK.eos_id], [0.0] * 3, [0] * 3)
  assert choice.text == "12" and choice.stopped_on_token and choice.finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, "min_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": 1}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_a_bad_field_is_named(body, param):
  with pytest.raises(ApiError) as err:
    parse_call(body, chat=True, max_n=4)
  assert err.value.status == 400 and err.value.param == param


def test_min_p_is_taken_as_vllm_takes_it():
  assert parse_call({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_p": 0.1}, chat=True,
                    max_n=4).min_p == 0.1


def test_neutral_openai_fields_and_text_parts_are_taken():
  call = parse_call({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}],
                     "presence_penalty": 0, "top_k": -1, "stream": False, "max_completion_tokens": 5},
                    chat=True, max_n=4)
  assert call.messages == ({"role": "user", "content": "ab"},) and call.max_tokens == 5 and call.top_k == 0


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """The tests' byte-level BPE tokenizer (merges 'Ġ t', 'h e', 'Ġt he'; ChatML)."""
  from streamrl_jax.models import load_tokenizer
  from tests.serving_setup import tiny_model_dir

  return load_tokenizer(tiny_model_dir(tmp_path_factory))


def _reply(tokenizer, ids, stop=True):
  choice = ChoiceText(tokenizer.decode, (), tokenizer.stop_ids)
  tokens = list(ids) + ([tokenizer.eos_id] if stop else [])
  choice.finish("stop" if stop else "length", tokens, [-0.5] * len(tokens), [3] * len(tokens))
  return choice


def test_an_episode_trains_on_the_sampled_ids_even_where_the_text_retokenizes_differently(bpe):
  vocab = bpe.vocab()
  sampled = [vocab["Ġ"], vocab["t"], vocab["h"], vocab["e"]]  # " the" as four tokens
  assert bpe.decode(sampled) == " the" and bpe.encode(" the") == [vocab["Ġthe"]]  # re-encoded: one token
  episodes = Episodes(bpe.encode, bpe.token_text, bpe.decode)
  episodes.open("e1", budget=64)
  chat = [{"role": "user", "content": "say it"}]
  first = episodes.begin("e1", bpe.render_chat(chat), bpe.encode, 1)
  assert first.prompt_tokens.tolist() == bpe.apply_chat_template(chat) and first.added == ()
  episodes.record(first, _reply(bpe, sampled))
  chat += [{"role": "assistant", "content": " the"}, {"role": "user", "content": "again"}]
  second = episodes.begin("e1", bpe.render_chat(chat), bpe.encode, 1)
  expected_prompt = bpe.apply_chat_template(chat[:1]) + sampled + [bpe.eos_id]
  assert second.prompt_tokens.tolist()[:len(expected_prompt)] == expected_prompt
  assert vocab["Ġthe"] not in second.prompt_tokens.tolist()
  # what follows the sampled stop token: the template's newline, the user's turn and the next assistant header
  assert bpe.token_text(second.added[0]) == "\n" and bpe.decode(list(second.added)).endswith("assistant\n")
  episodes.record(second, _reply(bpe, [vocab["a"]], stop=False))
  transcript = episodes.close("e1")
  assert transcript.prompt_tokens == bpe.apply_chat_template(chat[:1])
  assert transcript.tokens == sampled + [bpe.eos_id] + list(second.added) + [vocab["a"]]
  assert transcript.loss_mask == [True] * 5 + [False] * len(second.added) + [True]
  assert transcript.logprobs == [-0.5] * 5 + [0.0] * len(second.added) + [-0.5]
  assert transcript.versions == [3] * len(transcript.tokens) and transcript.turns == 2


def test_an_episode_refuses_a_conversation_that_does_not_continue_it_and_a_spent_budget(bpe):
  episodes = Episodes(bpe.encode, bpe.token_text, bpe.decode)
  episodes.open("e", budget=6)
  chat = [{"role": "user", "content": "hi"}]
  turn = episodes.begin("e", bpe.render_chat(chat), bpe.encode, 1)
  with pytest.raises(ApiError, match="one at a time"):
    episodes.begin("e", bpe.render_chat(chat), bpe.encode, 1)
  episodes.record(turn, _reply(bpe, bpe.encode("ok")))
  edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}, {"role": "user", "content": "x"}]
  with pytest.raises(ApiError, match="differ at character") as err:
    episodes.begin("e", bpe.render_chat(edited), bpe.encode, 1)
  assert err.value.code == "episode_diverged"
  kept = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
  with pytest.raises(ApiError, match="used its 6 tokens"):
    episodes.begin("e", bpe.render_chat(kept), bpe.encode, 1)
  with pytest.raises(ApiError, match="unknown episode"):
    episodes.begin("other", bpe.render_chat(chat), bpe.encode, 1)


def test_a_template_that_renders_past_turns_anew_is_placed_after_the_sampled_ids_and_counted(bpe):
  """Qwen3's template drops a past reply's reasoning: the next turn's rendering does not start with the text sampled.
  The turn goes on from the sampled ids (the reasoning kept), the template's text after the reply added, and the
  transcript counts it; a request whose messages do not continue the episode's is still refused."""
  from pathlib import Path

  from streamrl_jax.models.chat import render_chat

  template = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
  render = lambda messages, gen=True: render_chat(template, messages, gen)  # noqa: E731
  episodes = Episodes(bpe.encode, bpe.token_text, bpe.decode, render)
  episodes.open("q", budget=200)
  chat = [{"role": "user", "content": "hi"}]
  first = episodes.begin("q", render(chat), bpe.encode, 1, tuple(chat))
  sampled = bpe.encode("<think>\nsay ok\n</think>\n\nok")
  episodes.record(first, _reply(bpe, sampled))
  reply = episodes._open["q"].reply
  chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
  assert not render(chat).startswith(render(chat[:1]) + reply)  # the reasoning is gone from the history
  second = episodes.begin("q", render(chat), bpe.encode, 1, tuple(chat))
  so_far = bpe.encode(render(chat[:1])) + sampled + [bpe.eos_id]
  assert second.prompt_tokens.tolist()[:len(so_far)] == so_far  # the sampled ids, reasoning included
  assert bpe.decode(list(second.added)) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n".replace(
      "<|im_start|>", "").replace("<|im_end|>", "")  # (decode leaves the special tokens out)
  assert episodes._open["q"].prefix_mismatches == 1
  episodes.record(second, _reply(bpe, bpe.encode("fine")))
  edited = [chat[0], {"role": "assistant", "content": "not what was sent"}, *chat[2:],
            {"role": "assistant", "content": "fine"}, {"role": "user", "content": "x"}]
  with pytest.raises(ApiError, match="does not continue") as err:
    episodes.begin("q", render(edited), bpe.encode, 1, tuple(edited))
  assert err.value.code == "episode_diverged" and episodes.close("q").prefix_mismatches == 1
