"""Prompts as transformers builds them: chat templates that use each feature of transformers' environment, raw
prompts through a tokenizer's BOS post-processor, and every stop id; ours against `AutoTokenizer`, id for id."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from tests.gguf_files import CHATML, byte_alphabet
from streamrl_jax.models import chat as chat_module
from streamrl_jax.models import load_tokenizer
from streamrl_jax.models.chat import ChatFormat, ChatTemplateError, render_chat
from streamrl_jax.tasks.config import TaskConfig

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|start_header_id|>",
            "<|end_header_id|>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
TEMPLATES = Path(__file__).parent / "templates"  # the families' own templates, as their tokenizer_config.json has them

# A Llama 3 style template: BOS from the tokenizer, a namespace, today's date, tools as indented JSON, loop controls
# (a message of role "note" is skipped, one of role "stop" ends the conversation), turns closed with <|eot_id|>.
LLAMA3_LIKE = """{{ bos_token }}{% set ns = namespace(system='') %}
{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ strftime_now('%d %b %Y') }}
{% if tools %}You may call these tools:
{% for tool in tools %}{{ tool | tojson(indent=2) }}
{% endfor %}{% endif %}{{ ns.system }}<|eot_id|>
{% for message in messages %}
{% if message['role'] == 'system' or message['role'] == 'note' %}{% continue %}{% endif %}
{% if message['role'] == 'stop' %}{% break %}{% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# A Llama 2 / Mistral style template: BOS written by the template, an assistant turn closed with eos_token, and
# raise_exception for roles that do not alternate.
MISTRAL_LIKE = ("{{ bos_token }}{% for message in messages %}"
                "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
                "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")

TOOLS = [{"type": "function", "function": {"name": "convert", "description": "Prix en € pour <a> & 'b' — ✓",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}}]
TEXTS = ["the cat sat", "  two  spaces\nand a line", "€ and <&'>", "<|eot_id|> inside"]


def _tokenizer(bos: str | None) -> tokenizers.Tokenizer:
  """Byte-level BPE over the 256 bytes (no merges), the specials above, and a post-processor adding `bos`."""
  vocab = {t: i for i, t in enumerate(SPECIALS + byte_alphabet())}
  tok = tokenizers.Tokenizer(models.BPE(vocab, [], fuse_unk=False))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  if bos:
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, vocab[bos])])
  return tok


def _model_dir(path, *, template: str, post_processor: str | None = None, generation: dict | None = None,
               **settings):
  path.mkdir()
  _tokenizer(post_processor).save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(dict(tokenizer_class="PreTrainedTokenizerFast",
                                                              chat_template=template, **settings)))
  if generation is not None:
    (path / "generation_config.json").write_text(json.dumps(generation))
  return path


@pytest.fixture
def frozen_clock(monkeypatch):
  """Both renderers see one moment, so a test never races midnight."""
  import transformers.utils.chat_template_utils as hf_chat

  moment = datetime.datetime(2026, 3, 14, 15, 9, 26)

  class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
      return moment

  monkeypatch.setattr(hf_chat, "datetime", Frozen)
  monkeypatch.setattr(chat_module, "_now", lambda: moment)
  return moment


@pytest.fixture
def llama3_dir(tmp_path):
  return _model_dir(tmp_path / "llama3", template=LLAMA3_LIKE, post_processor="<|begin_of_text|>", bos_token="<|begin_of_text|>",
                    eos_token="<|eot_id|>", generation=dict(bos_token_id=0, eos_token_id=[1, 3, 2]))


@pytest.fixture
def mistral_dir(tmp_path):
  return _model_dir(tmp_path / "mistral", template=MISTRAL_LIKE, post_processor="<s>", bos_token="<s>",
                    eos_token="</s>", unk_token="<unk>", add_bos_token=True)


def _theirs(directory):
  import transformers

  return transformers.AutoTokenizer.from_pretrained(str(directory))


def _same_chat(ours, theirs, messages, **kwargs):
  text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
  assert ours.render_chat(messages, **kwargs) == text
  ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True, **kwargs)
  assert ours.apply_chat_template(messages, **kwargs) == list(ids)
  return text


def test_llama3_like_template_matches_transformers_id_for_id(llama3_dir, frozen_clock):
  ours, theirs = load_tokenizer(llama3_dir), _theirs(llama3_dir)
  conversation = [{"role": "system", "content": "Be brief."}, {"role": "note", "content": "skipped"},
                  {"role": "user", "content": "  What is 2 + 2?  "}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And €3 + <b>?"}, {"role": "stop", "content": "x"},
                  {"role": "user", "content": "never rendered"}]
  text = _same_chat(ours, theirs, conversation, tools=TOOLS)
  assert text.startswith("<|begin_of_text|><|start_header_id|>system") and text.count("<|begin_of_text|>") == 1
  assert "Today Date: 14 Mar 2026" in text  # strftime_now
  assert '"description": "Prix en € pour <a> & \'b\' — ✓"' in text and '\n  "type": "function"' in text  # tojson
  assert "skipped" not in text and "never rendered" not in text and "What is 2 + 2?<|eot_id|>" in text  # loops, trim
  _same_chat(ours, theirs, [{"role": "user", "content": "hi"}])
  # One BOS, as transformers gives it: the template's, not a second from the post-processor.
  assert ours.apply_chat_template([{"role": "user", "content": "hi"}]).count(0) == 1


def test_qwen3_template_with_and_without_thinking_matches_transformers_id_for_id(tmp_path):
  """Qwen3's template: `enable_thinking` (False opens the answer with an empty think block), past turns' reasoning
  dropped from the history, tools and tool responses."""
  directory = _model_dir(tmp_path / "qwen3", template=(TEMPLATES / "qwen3.jinja").read_text(), eos_token="<|im_end|>",
                         pad_token="<|im_end|>")
  ours, theirs = load_tokenizer(directory), _theirs(directory)
  question = [{"role": "user", "content": "What is 2 + 2?"}]
  for options in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
    text = _same_chat(ours, theirs, question, **options)
    assert text.endswith("<think>\n\n</think>\n\n") == (options.get("enable_thinking") is False)
  history = [{"role": "system", "content": "Be brief."}, *question,
             {"role": "assistant", "content": "<think>\n2 and 2 make 4.\n</think>\n\n4"},
             {"role": "user", "content": "And 3 + 3?"}]
  text = _same_chat(ours, theirs, history, tools=TOOLS)
  assert "2 and 2 make 4" not in text and "<|im_start|>assistant\n4<|im_end|>" in text  # the past reasoning dropped
  tool_turns = [*question, {"role": "assistant", "content": "", "tool_calls": [
      {"function": {"name": "convert", "arguments": {"x": 2}}}]}, {"role": "tool", "content": "4"}]
  _same_chat(ours, theirs, tool_turns, tools=TOOLS, enable_thinking=False)
  assert ours.stop_ids and ours.encode("<|im_end|>")[0] in ours.stop_ids
  chat = ours.chat_format(None, {"enable_thinking": False})  # a task's prompts without thinking
  assert chat.wrap("2+2?") == theirs.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                                         add_generation_prompt=True, enable_thinking=False)
  assert chat.unwrap(chat.wrap("2+2?")) == "2+2?"


def test_gemma3_template_matches_transformers_id_for_id(tmp_path):
  """Gemma 3's template: BOS from the template, the system message folded into the first user turn, the
  assistant's turns as the model's, and alternation enforced."""
  directory = _model_dir(tmp_path / "gemma3", template=(TEMPLATES / "gemma3.jinja").read_text(), bos_token="<bos>",
                         eos_token="<eos>", post_processor="<bos>", generation=dict(bos_token_id=13, eos_token_id=[14, 16]))
  ours, theirs = load_tokenizer(directory), _theirs(directory)
  conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2 + 2?  "},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "And €3 + <b>?"}]
  text = _same_chat(ours, theirs, conversation)
  assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model")
  assert ours.apply_chat_template(conversation).count(ours.encode("<bos>")[0]) == 1  # the template's BOS alone
  with pytest.raises(chat_module.ChatTemplateError, match="Conversation roles must alternate"):
    ours.render_chat([{"role": "assistant", "content": "hi"}])
  assert set(ours.encode("<end_of_turn>")) <= set(ours.stop_ids)  # an instruct Gemma stops at its turn's end
  assert ours.encode_prompt("hi")[0] == ours.encode("<bos>")[0]  # a raw prompt gets the post-processor's BOS


def test_raw_prompts_get_the_post_processors_bos(llama3_dir, mistral_dir, tmp_path):
  plain = _model_dir(tmp_path / "plain", template=CHATML, eos_token="<|im_end|>")  # no post-processor
  # transformers 5 follows tokenizer.json's post-processor, not tokenizer_config.json's add_bos_token
  flag_only = _model_dir(tmp_path / "flag", template=CHATML, bos_token="<s>", eos_token="</s>", add_bos_token=True)
  for directory, first in ((llama3_dir, 0), (mistral_dir, SPECIALS.index("<s>")), (plain, None), (flag_only, None)):
    ours, theirs = load_tokenizer(directory), _theirs(directory)
    for text in TEXTS:
      assert ours.encode_prompt(text) == theirs(text)["input_ids"], (directory.name, text)
      assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], (directory.name, text)
    ids = ours.encode_prompt("the cat")
    assert (ids[0] == first) if first is not None else ids[0] != 0
  assert load_tokenizer(plain).encode_prompt("a") == load_tokenizer(plain).encode("a")


def test_stop_ids_are_every_eos_transformers_stops_on(llama3_dir, mistral_dir):
  import transformers

  ours = load_tokenizer(llama3_dir)
  generation = transformers.GenerationConfig.from_pretrained(str(llama3_dir))
  assert set(generation.eos_token_id) <= set(ours.stop_ids)
  assert ours.eos_id == ours.stop_ids[0] == SPECIALS.index("<|eot_id|>")
  assert set(ours.stop_ids) == {SPECIALS.index(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")}
  # Mistral style: no generation config; the assistant turn is closed by eos_token, which the template names.
  assert load_tokenizer(mistral_dir).stop_ids == (SPECIALS.index("</s>"),)


def test_assistant_turn_closed_with_eos_token_matches_transformers(mistral_dir):
  ours, theirs = load_tokenizer(mistral_dir), _theirs(mistral_dir)
  conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "3+3?"}]
  text = _same_chat(ours, theirs, conversation)
  assert text == "<s>[INST] 2+2? [/INST]4</s>[INST] 3+3? [/INST]"
  with pytest.raises(ChatTemplateError, match=f"{mistral_dir}: the chat template raised: Conversation roles must "):
    ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_chat_format_holds_for_a_default_system_message_and_a_date(llama3_dir, tmp_path, frozen_clock,
                                                                   monkeypatch):
  smol = _model_dir(tmp_path / "smol", template=CHATML, eos_token="<|im_end|>")
  chat = load_tokenizer(smol).chat_format()
  assert chat.wrap("2+2?").startswith("<|im_start|>system\nYou are a test model.<|im_end|>\n<|im_start|>user\n2+2?")
  assert chat.unwrap(chat.wrap("2+2?")) == "2+2?" and chat.pattern is None
  ours, theirs = load_tokenizer(llama3_dir), _theirs(llama3_dir)
  dated = ours.chat_format("Be brief.")
  assert dated.pattern is not None  # the date changes with the clock
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 5?"}]
  prompt = dated.wrap("What is 7 + 5?")
  assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  monkeypatch.setattr(chat_module, "_now", lambda: datetime.datetime(2027, 1, 2))  # a prompt made on another day
  later = dated.wrap("What is 7 + 5?")
  assert later != prompt and "02 Jan 2027" in later
  assert dated.unwrap(prompt) == dated.unwrap(later) == "What is 7 + 5?"
  with pytest.raises(ValueError, match="not a prompt of this chat format"):
    dated.unwrap("What is 7 + 5?")


def test_generation_blocks_and_namespace_guard():
  template = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
              "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")
  assert render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "ab2"
  with pytest.raises(Exception, match="may not set '_x'"):
    render_chat("{% set ns = namespace(_x=1) %}", [])
  assert render_chat("{{ messages | tojson }}", [{"role": "user", "content": "é", "name": None}]) == \
      '[{"role": "user", "content": "é"}]'  # non-ASCII kept, a None key dropped as transformers does


def test_bad_templates_and_configs_are_named_at_load(tmp_path):
  broken = _model_dir(tmp_path / "broken", template="{% for m in messages %}{{ m }}", eos_token="<|im_end|>")
  with pytest.raises(ChatTemplateError, match=f"{broken}: the chat template does not compile: .*endfor"):
    load_tokenizer(broken)
  twice = _model_dir(tmp_path / "twice", template="{% for m in messages %}{{ m['content'] }}{{ m['content'] }}"
                     "{% endfor %}", eos_token="<|im_end|>")
  with pytest.raises(ValueError, match=f"chat template of {twice} does not place the user message"):
    load_tokenizer(twice).chat_format()
  bad_json = _model_dir(tmp_path / "gen", template=CHATML, eos_token="<|im_end|>")
  (bad_json / "generation_config.json").write_text("{eos_token_id: [1, 2")
  with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
    load_tokenizer(bad_json)
  (bad_json / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10 ** 6]}))
  with pytest.raises(ValueError, match="eos_token_id 1000000 is outside the vocabulary"):
    load_tokenizer(bad_json)
  (bad_json / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
  with pytest.raises(ValueError, match="eos_token_id must be an id or a list of ids"):
    load_tokenizer(bad_json)


def test_gguf_add_bos_flag_reaches_the_converted_directory(tmp_path):
  from tests.gguf_files import write_gguf
  from streamrl_jax.models import gguf as gguf_io

  for add_bos in (False, True):
    out = gguf_io.convert(write_gguf(tmp_path / f"{add_bos}.gguf", add_bos=add_bos), tmp_path / f"hf{add_bos}")
    ours, theirs = load_tokenizer(out), _theirs(out)
    assert ours.encode_prompt("the cat") == theirs("the cat")["input_ids"]
    assert (ours.encode_prompt("the cat")[0] == 1) == add_bos  # <|im_start|> is the test GGUF's BOS
    messages = [{"role": "user", "content": "the cat"}]
    assert ours.apply_chat_template(messages) == list(theirs.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True))
    assert ours.stop_ids == (2,)


def test_smollm2_template_and_tokenizer_match_transformers(smollm2):
  directory = smollm2
  ours, theirs = load_tokenizer(directory), _theirs(directory)
  for messages in ([{"role": "user", "content": "What is 12 + 34? Reply with only the number."}],
                   [{"role": "system", "content": "Reply with only the answer."},
                    {"role": "user", "content": "Prix: 3 €, <b> & 'c'"}]):
    _same_chat(ours, theirs, messages)
  for text in TEXTS:
    assert ours.encode_prompt(text) == theirs(text)["input_ids"]
  assert theirs.eos_token_id in ours.stop_ids


def test_the_pipeline_trains_and_evaluates_on_transformers_ids(tmp_path, monkeypatch):
  """A GGUF model whose tokenizer adds BOS, with and without `TaskConfig.chat`: the prompt ids the controller, the
  sampler and evaluation use are transformers' ids for the same question, and evaluation stops on every stop id."""
  import numpy as np

  from streamrl_jax.job import evaluation
  from streamrl_jax.job.config import JobConfig
  from streamrl_jax.pipeline.config import PipelineConfig
  from streamrl_jax.tasks import draw, prompt_tokens, question
  from tests.gguf_files import write_gguf

  monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path / "cache"))
  gguf = write_gguf(tmp_path / "m.gguf", add_bos=True)
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in ("the cat", "€ <in> a hat")))
  submitted = []

  class Recorder:  # stands in for the continuous batcher: records what evaluation hands it
    def __init__(self, engines, params, tools=None):
      pass

    def submit(self, ids, knobs):
      submitted.append((list(ids), knobs.stop_token_ids))
      return [len(submitted)]

    def stream(self):
      return iter(())

  monkeypatch.setattr(evaluation, "StreamingSampler", Recorder)
  for chat in (False, True):
    job = JobConfig(model=str(gguf), task=TaskConfig(name="file", prompt_file=str(rows), chat=chat,
                                                     system_prompt="Be brief." if chat else ""))
    model, tokenizer, _ = job.load_model()
    theirs = _theirs(job.model_path())
    task = job.make_task(tokenizer)
    expected, rng = [], np.random.default_rng(10_000)  # evaluation's own seed
    for prompt, _row in (draw(task, rng) for _ in range(2)):
      text = question(task, prompt)
      messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
      ids = (list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True))
             if chat else theirs(text)["input_ids"])
      assert prompt_tokens(task, tokenizer, prompt) == ids
      assert ids[0] == 1 and ids[1] != 1  # one BOS (<|im_start|>): the post-processor's, or the template's
      expected.append(ids)
    submitted.clear()
    run = PipelineConfig()
    evaluation.HeldOut(tokenizer, task, run.sampler, run.max_new_tokens, prompts=2, seed=0).rows(model)
    assert [ids for ids, _ in submitted] == expected
    assert all(stops == tokenizer.stop_ids for _, stops in submitted)


def test_generate_command_encodes_as_transformers_and_cuts_at_any_stop_id(tmp_path, monkeypatch, capsys):
  import numpy as np

  from streamrl_jax import cli
  from streamrl_jax import models as models_module
  from tests.gguf_files import vocabulary, write_gguf

  monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path / "cache"))
  gguf = write_gguf(tmp_path / "m.gguf", add_bos=True)
  calls, the = [], vocabulary().index("Ġthe")

  def recorder(model, tokens, mask, max_new_tokens, **kwargs):
    calls.append([row[m].tolist() for row, m in zip(np.asarray(tokens), np.asarray(mask, bool))])
    return np.asarray([[the, 2, the, the]] * len(tokens))  # " the", the stop id <|im_end|>, then text never shown

  monkeypatch.setattr(models_module, "generate", recorder)
  for extra in ([], ["--chat", "--system", "Be brief."]):
    calls.clear()
    assert cli.main(["generate", "--model", str(gguf), "--prompt", "the cat", "--max-new-tokens", "4", *extra]) == 0
    out = capsys.readouterr().out
    theirs = _theirs(next((tmp_path / "cache" / "gguf").iterdir()))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]
    want = (theirs.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True)
            if extra else theirs("the cat")["input_ids"])
    assert calls[0] == [list(want)] and calls[1] == [list(want)]  # compile run, then the timed run
    assert "'the cat' -> ' the'\n" in out, out

