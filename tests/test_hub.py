"""Models by Hugging Face Hub id and prompt files by hf://datasets URL, read from a Hub-layout cache built here:
offline with no connection opened, the parameters, prompt ids and rows of the same files as local ones, a revision
pinned to its snapshot, mistakes refused in one line."""

import json
import shutil
import socket

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax import cli
from streamrl_jax.models import load_hf, load_tokenizer
from streamrl_jax.models.catalog import base_model_id, resolve_model
from streamrl_jax.models.hub import HubError, hub_dataset, parse_hub_id
from streamrl_jax.job.config import JobConfig
from streamrl_jax.tasks.config import TaskConfig
from streamrl_jax.tasks.files import PromptFile
from tests.checkpoints import hub_layout, word_checkpoint, write_parquet

REPO, MAIN, V1 = "tiny-org/word-model", "a" * 40, "b" * 40
PROMPT = "what is 3 plus 4 ?"


@pytest.fixture
def hub(hf_dirs, tmp_path, monkeypatch):
  """(cache, main's files, v1's files): REPO's main is the tiny Qwen2 with a word tokenizer, its tag v1 (commit V1)
  the tiny Llama with the same tokenizer; HF_HUB_OFFLINE=1 and no socket may connect."""
  main = word_checkpoint(hf_dirs, tmp_path / "main")
  v1 = tmp_path / "v1"
  shutil.copytree(hf_dirs["llama"][0], v1)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(main / name, v1 / name)
  cache = tmp_path / "hub"
  hub_layout(cache, REPO, {MAIN: main, V1: v1}, {"main": MAIN, "v1": V1})
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")

  def refused(*args, **kwargs):
    raise AssertionError(f"a connection was opened under HF_HUB_OFFLINE=1: {args}")
  monkeypatch.setattr(socket.socket, "connect", refused)
  monkeypatch.setattr(socket, "getaddrinfo", refused)
  return cache, main, v1


def parameters(path) -> list:
  return jax.tree.leaves(nnx.state(load_hf(path)))


def assert_same_parameters(a, b) -> None:
  for x, y in zip(parameters(a), parameters(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hub_ids_are_told_from_paths_and_names():
  assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
  assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
  assert parse_hub_id("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
  for spec in ("smollm2-135m-instruct", "/abs/dir", "a/b/c", "org/", "./org/name", "org/na me"):
    assert parse_hub_id(spec) is None, spec
  assert base_model_id("org/name@v1.0") == "org/name" and base_model_id("org/name") == "org/name"


def test_a_hub_id_reads_the_cache_offline_as_its_directory_and_transformers_read_it(hub, hf_dirs):
  from transformers import AutoModelForCausalLM, AutoTokenizer

  cache, main, _ = hub
  path = resolve_model(REPO)
  assert path == cache / "models--tiny-org--word-model" / "snapshots" / MAIN
  assert_same_parameters(path, main)
  ids = load_tokenizer(path).encode_prompt(PROMPT)
  assert ids == load_tokenizer(main).encode_prompt(PROMPT) == [3, 4, 10, 5, 11, 6]
  theirs = AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache, local_files_only=True).state_dict()
  for name, tensor in hf_dirs["qwen2"][1].state_dict().items():
    np.testing.assert_array_equal(theirs[name].numpy(), tensor.numpy(), err_msg=name)
  by_id = AutoTokenizer.from_pretrained(REPO, cache_dir=cache, local_files_only=True)(PROMPT)["input_ids"]
  assert by_id == AutoTokenizer.from_pretrained(main)(PROMPT)["input_ids"]  # (ours against theirs: test_tokenizer)


def test_a_revision_pins_its_snapshot(hub):
  _, main, v1 = hub
  for spec in (f"{REPO}@{V1}", f"{REPO}@v1"):
    assert_same_parameters(resolve_model(spec), v1)
  assert_same_parameters(resolve_model(f"{REPO}@main"), main)


def test_what_cannot_be_had_is_refused_in_one_line_naming_the_model(hub, tmp_path):
  cache, main, _ = hub
  with pytest.raises(HubError, match=r"model 'tiny-org/absent' is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
    resolve_model("tiny-org/absent")
  with pytest.raises(HubError, match=rf"'{REPO}@v9' is not in the Hugging Face cache .* at revision 'v9'"):
    resolve_model(f"{REPO}@v9")
  gpt2 = tmp_path / "gpt2"  # its weights would come after config.json: an unsupported model is refused first
  gpt2.mkdir()
  (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
  no_weights = tmp_path / "no_weights"
  shutil.copytree(main, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
  hub_layout(cache, "tiny-org/gpt2", {MAIN: gpt2}, {"main": MAIN})
  hub_layout(cache, "tiny-org/bin-only", {MAIN: no_weights}, {"main": MAIN})
  with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
    resolve_model("tiny-org/gpt2")
  with pytest.raises(HubError, match=r"'tiny-org/bin-only' has no safetensors weights in its cached snapshot .* "
                                     r"HF_HUB_OFFLINE is set: fetch them with the network \(`hf download "
                                     r"tiny-org/bin-only`\)"):
    resolve_model("tiny-org/bin-only")
  with pytest.raises(ValueError, match=r"nor a Hugging Face Hub id \(org/name or org/name@revision\)"):
    resolve_model("no such model")


def test_generate_takes_a_hub_id_and_says_in_one_line_what_is_missing(hub, capsys):
  assert cli.main(["generate", "--model", REPO, "--prompt", PROMPT, "--max-new-tokens", "2"]) == 0
  assert PROMPT in capsys.readouterr().out
  assert cli.main(["generate", "--model", "tiny-org/absent", "--prompt", PROMPT]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("streamrl generate: error: model 'tiny-org/absent' is not in the Hugging Face cache")
  assert len(err.splitlines()) == 1 and "hf download tiny-org/absent" in err


def drawn(task, n: int = 6) -> list:
  rng = np.random.default_rng(7)
  return [task.sample(rng) for _ in range(n)]


def test_prompts_from_a_hub_dataset_are_the_rows_of_its_files(hub, tmp_path):
  cache, main, _ = hub
  rows = [{"question": f"what is {a} plus {b} ?", "answer": str(a + b)} for a in range(4) for b in range(3)]
  files = tmp_path / "gsm"
  write_parquet(files / "main" / "train-00000-of-00002.parquet", rows[:6])
  write_parquet(files / "main" / "train-00001-of-00002.parquet", rows[6:])
  write_parquet(files / "main" / "test-00000-of-00001.parquet", rows[:2])
  older = tmp_path / "older"
  write_parquet(older / "main" / "test-00000-of-00001.parquet", rows[-1:])
  hub_layout(cache, "tiny-org/sums", {MAIN: files, V1: older}, {"main": MAIN}, kind="dataset")
  shards = hub_dataset("hf://datasets/tiny-org/sums/main")  # a folder: its Parquet shards, in name order
  assert [r["prompt"] for r in PromptFile(shards)] == [r["question"] for r in rows[:2] + rows]
  test = hub_dataset("hf://datasets/tiny-org/sums/main/test-00000-of-00001.parquet")
  assert [r["fields"]["answer"] for r in PromptFile(test)] == ["0", "1"]
  pinned = hub_dataset(f"hf://datasets/tiny-org/sums@{V1}/main/test-00000-of-00001.parquet")
  assert [r["prompt"] for r in PromptFile(pinned)] == [rows[-1]["question"]]
  tokenizer = load_tokenizer(main)
  by_url = JobConfig(model=str(main), task=TaskConfig(name="file", prompt_file="hf://datasets/tiny-org/sums/main/"
                                                                             "train-00001-of-00002.parquet"))
  by_path = JobConfig(model=str(main), task=TaskConfig(name="file", prompt_file=str(files / "main" /
                                                                                    "train-00001-of-00002.parquet")))
  assert drawn(by_url.make_task(tokenizer)) == drawn(by_path.make_task(tokenizer))
  with pytest.raises(HubError, match=r"dataset 'hf://datasets/tiny-org/absent/x.parquet' is not in the Hugging "
                                     r"Face cache .*hf download tiny-org/absent --repo-type dataset"):
    hub_dataset("hf://datasets/tiny-org/absent/x.parquet")
  with pytest.raises(ValueError, match=r"a Hub dataset is hf://datasets/org/name/path"):
    hub_dataset("hf://datasets/no-path")


def test_launch_local_pins_a_hub_id_to_its_commit_for_every_process(hub, tmp_path):
  from streamrl_jax import gin_config

  config = tmp_path / "hub.gin"
  config.write_text(f"JobConfig.model = '{REPO}'\n")
  try:
    assert gin_config.pinned_hub_model([str(config)], []) == [f"JobConfig.model='{REPO}@{MAIN}'"]
    tagged = gin_config.pinned_hub_model([str(config)], [f"JobConfig.model='{REPO}@v1'"])
    assert tagged[-1] == f"JobConfig.model='{REPO}@{V1}'"
    no_hub_id = ["PipelineConfig.steps=2"]
    assert gin_config.pinned_hub_model([], no_hub_id) == no_hub_id  # as given
  finally:
    gin_config.parse()


@pytest.mark.parametrize("error, said", [
    ("GatedRepoError", r"model 'org/m@v9' is gated on the Hugging Face Hub: accept its terms at https://huggingface.co/"
                       r"org/m, then set HF_TOKEN"),
    ("RepositoryNotFoundError", r"model 'org/m@v9' is not on the Hugging Face Hub \(check the id; a private model "
                                r"needs HF_TOKEN\)"),
    ("RevisionNotFoundError", r"model 'org/m@v9' has no revision 'v9' on the Hub \(a branch, tag or commit of "
                              r"https://huggingface.co/org/m\)"),
    ("ConnectionError", r"model 'org/m@v9' could not be fetched from the Hugging Face Hub \(ConnectionError: no "
                        r"route\); check the network"),
])
def test_what_the_hub_answers_online_is_one_line_naming_the_model(monkeypatch, tmp_path, error, said):
  import httpx
  from huggingface_hub import errors

  from streamrl_jax.models import hub

  def failing(*args, **kwargs):
    if error == "ConnectionError":  # no network
      raise ConnectionError("no route")
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/org/m"))
    raise getattr(errors, error)("refused", response=response)
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
  monkeypatch.setattr(hub, "offline", lambda: False)
  monkeypatch.setattr(hub, "unreachable", lambda url: None)  # the Hub answers
  monkeypatch.setattr(hub, "_download", failing)
  with pytest.raises(HubError, match=said) as raised:
    hub.hub_model("org/m@v9")
  assert "\n" not in str(raised.value)


@pytest.fixture
def online(monkeypatch):
  """HF_HUB_OFFLINE unset, no proxy, HF_ENDPOINT unset, the Hub not yet probed in this process; the probes made."""
  from huggingface_hub import constants

  from streamrl_jax.models import hub

  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  for name in (*hub._PROXIES, "HF_ENDPOINT"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(hub, "_probed", {})
  probes = []
  connect = socket.create_connection

  def counted(address, *args, **kwargs):
    probes.append(address)
    return connect(address, *args, **kwargs)
  monkeypatch.setattr(socket, "create_connection", counted)
  return probes


@pytest.fixture
def lookups(monkeypatch):
  """huggingface_hub's download functions, failing the test when asked to look anything up on the network."""
  import huggingface_hub

  calls = []
  for name in ("hf_hub_download", "snapshot_download"):
    def spied(*args, _real=getattr(huggingface_hub, name), _name=name, **kwargs):
      calls.append(_name)
      assert kwargs.get("local_files_only"), f"{_name} looked {args} up on the network"
      return _real(*args, **kwargs)
    monkeypatch.setattr(huggingface_hub, name, spied)
  return calls


def test_an_unreachable_hub_is_said_at_once_in_one_line_naming_the_model_and_endpoint(online, lookups, monkeypatch,
                                                                                       tmp_path):
  with socket.socket() as free:  # a port nothing listens on: connections refused
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  monkeypatch.setenv("HF_ENDPOINT", url)
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
  model = "HuggingFaceTB/SmolLM2-135M-Instruct"
  with pytest.raises(HubError) as raised:
    resolve_model(model)
  said = str(raised.value)
  assert "\n" not in said
  assert said.startswith(f"model {model!r} is not in the Hugging Face cache {tmp_path} and the Hugging Face Hub at "
                         f"{url} cannot be reached (no connection to 127.0.0.1:{port}: ")
  assert said.endswith(f"copy the model into {tmp_path} and set HF_HUB_OFFLINE=1")
  with pytest.raises(HubError, match=rf"^dataset 'hf://datasets/org/rows/x.parquet' is not in the Hugging Face cache "
                                     rf".* the Hugging Face Hub at {url} cannot be reached .* copy the dataset into"):
    hub_dataset("hf://datasets/org/rows/x.parquet")
  assert online == [("127.0.0.1", port)]  # probed once, for both
  assert lookups == ["hf_hub_download", "hf_hub_download"]  # the cache's alone


def test_an_unreachable_hub_leaves_the_cached_snapshot_read(hub, online, lookups, monkeypatch, caplog):
  from streamrl_jax.models.hub import pinned

  def unreachable(address, *args, **kwargs):
    raise OSError(101, "Network is unreachable")
  monkeypatch.setattr(socket, "create_connection", unreachable)
  cache, main, _ = hub
  with caplog.at_level("WARNING", logger="streamrl_jax.models.hub"):
    assert resolve_model(REPO) == cache / "models--tiny-org--word-model" / "snapshots" / MAIN
  assert [r.getMessage() for r in caplog.records] == [
      "the Hugging Face Hub at https://huggingface.co cannot be reached (no connection to huggingface.co:443: "
      f"[Errno 101] Network is unreachable): model '{REPO}' read from its cached snapshot {cache}/models--tiny-org--"
      f"word-model/snapshots/{MAIN}"]
  assert pinned(REPO) == f"{REPO}@{MAIN}"
  with pytest.raises(HubError, match=r"^model 'tiny-org/absent' is not in the Hugging Face cache .* and the Hugging "
                                     r"Face Hub at https://huggingface.co cannot be reached \(no connection to "
                                     r"huggingface.co:443: \[Errno 101\] Network is unreachable\): check the network"):
    resolve_model("tiny-org/absent")
  assert set(lookups) == {"hf_hub_download", "snapshot_download"}


@pytest.mark.parametrize("proxy", ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "ALL_PROXY"])
def test_behind_a_proxy_the_proxy_decides_with_no_probe(online, monkeypatch, tmp_path, proxy):
  from streamrl_jax.models import hub

  asked = []

  def failing(*args, **kwargs):
    asked.append(args[3])  # local_files_only
    raise ConnectionError("proxy refused")
  monkeypatch.setenv(proxy, "http://127.0.0.1:9")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
  monkeypatch.setattr(hub, "_download", failing)
  with pytest.raises(HubError, match=r"^model 'org/m' could not be fetched from the Hugging Face Hub "
                                     r"\(ConnectionError: proxy refused\)"):
    hub.hub_model("org/m")
  assert asked == [False] and online == []  # looked up through the proxy, no probe


def test_a_name_lookup_that_hangs_is_cut_short(monkeypatch):
  import threading

  from streamrl_jax.models import hub

  release = threading.Event()

  def hanging(*args, **kwargs):
    release.wait(10)
    raise OSError("answered late")
  monkeypatch.setattr(socket, "create_connection", hanging)
  try:
    assert hub._probe("https://hub.example:8443", timeout=0.01) == "no connection to hub.example:8443 within 0.01 s"
  finally:
    release.set()
