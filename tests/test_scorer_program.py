"""A teacher's or judge's stage on a pool that is a program of its own (`streamrl scorer`, over Flight): its scores
equal the local model's, a scorer of another stage, kind or vocabulary is refused when the trainer connects, bad
requests are refused by name, and a run's judge stage is served by a scorer process."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.messages import BadMessage, ScoreRequest, Scores
from streamrl_jax.models import Transformer
from streamrl_jax.models.hf_io import save_hf
from streamrl_jax.training import ObjectiveConfig
from streamrl_jax.training.call_loss import CallLoss
from streamrl_jax.workflow import GraphError, WorkflowConfig
from streamrl_jax.workflow import remote
from streamrl_jax.workflow.judge import load_judge
from streamrl_jax.workflow.pools import Student
from streamrl_jax.workflow.remote import RemoteScorer, ScorerFlightServer
from streamrl_jax.workflow.teacher import load_teacher
from tests.pipeline_setup import BASE, MODEL, TOKENIZER
from tests.processes import TIMEOUT_S, metrics, train, write_config
from tests.xla_flags import xla_flags


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("scorer") / "model"
  save_hf(Transformer(MODEL, rngs=nnx.Rngs(11)), path)
  return path


def _mesh():
  return mesh_from_devices(jax.devices()[6:8], MeshShape(2, 1, 1))


def _rows(rows=5, length=9, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, MODEL.vocab_size, (rows, length)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[1, 5:] = False
  return tokens, valid


def test_a_judge_and_a_teacher_served_by_a_scorer_score_as_the_local_models(model_dir, monkeypatch):
  judge = load_judge(str(model_dir), "\nRight?", Student(MODEL.vocab_size, "float32", 12, TOKENIZER), _mesh())
  teacher = load_teacher(str(model_dir), MODEL.vocab_size, "float32", _mesh(), CallLoss(ObjectiveConfig(),
                         BASE.trainer, 1.0), 12)
  tokens, valid = _rows()
  for stage, model in (("judge", judge), ("teacher", teacher)):
    server = ScorerFlightServer("127.0.0.1", 0, stage=stage, kind=stage, vocab_size=MODEL.vocab_size, score=model)
    try:
      monkeypatch.setattr(remote, "REQUEST_TOKENS", 2 * tokens.shape[1])  # 2 rows a request: 3 requests
      client = RemoteScorer(server.address, stage, stage, MODEL.vocab_size)
      np.testing.assert_array_equal(client(tokens, valid), model(tokens, valid))
      assert server.counters.requests == 3 and server.counters.rows == 5
      with pytest.raises(GraphError, match=f"stage 'other' at {server.address}: .*serves stage '{stage}', not 'other'"):
        RemoteScorer(server.address, "other", stage, MODEL.vocab_size)
      with pytest.raises(GraphError, match=f"the scorer serves a {stage} reading {MODEL.vocab_size} token ids; the "
                                           f"stage needs a {stage} of the policy's {MODEL.vocab_size + 1}"):
        RemoteScorer(server.address, stage, stage, MODEL.vocab_size + 1)
      bad = ScoreRequest(1, 2, (1, MODEL.vocab_size), (True, True))
      with pytest.raises(BadMessage, match=f"token id {MODEL.vocab_size} is not below the scorer's vocabulary"):
        client.connection.action(bad, Scores)
      assert server.counters.refused == 2  # the other stage and the token id (the vocabulary: the client refuses)
      client.close()
    finally:
      server.shutdown()


def test_a_scorer_with_mutual_tls_serves_a_client_with_a_certificate_only(model_dir, tmp_path):
  from streamrl_jax.streaming.flight_server import TLSFiles
  from tests.tls_certs import write_test_certificates

  certs = write_test_certificates(tmp_path)
  tls = {side: TLSFiles(str(certs[f"{side}_cert"]), str(certs[f"{side}_key"]), str(certs["ca"]))
         for side in ("server", "client")}
  judge = load_judge(str(model_dir), "\nRight?", Student(MODEL.vocab_size, "float32", 12, TOKENIZER), _mesh())
  server = ScorerFlightServer("127.0.0.1", 0, stage="judge", kind="judge", vocab_size=MODEL.vocab_size, score=judge,
                              tls=tls["server"])
  try:
    tokens, valid = _rows()
    client = RemoteScorer(server.address, "judge", "judge", MODEL.vocab_size, tls["client"])
    np.testing.assert_array_equal(client(tokens, valid), judge(tokens, valid))
    with pytest.raises(ConnectionError, match="did not take the call"):  # no certificate: never served
      RemoteScorer(server.address, "judge", "judge", MODEL.vocab_size, retry_s=1.0)
  finally:
    server.shutdown()


def test_a_scorer_pool_is_checked_with_the_graph():
  with pytest.raises(GraphError, match="is not 'name=devices' or 'name=HOST:PORT'"):
    WorkflowConfig(pools=("judge=localhost",))
  with pytest.raises(GraphError, match=r"pool 'far' is a scorer program \(127.0.0.1:5\): it serves one teacher or "
                                       r"judge stage, not \['advantage'\]"):
    WorkflowConfig(pools=("far=127.0.0.1:5",), bind=("advantage=far",)).order()
  with pytest.raises(GraphError, match="pool 'far' has no stage bound to it"):
    WorkflowConfig(pools=("far=127.0.0.1:5",)).order()
  workflow = WorkflowConfig(graph="judge", judge="j", pools=("far=127.0.0.1:5",), bind=("judge=far",))
  assert workflow.remote_pools() == {"far": "127.0.0.1:5"} and workflow.own_pools() == {}
  assert [s.pool for s in workflow.order() if s.name == "judge"] == ["far"]


@pytest.mark.slow
def test_a_runs_judge_stage_is_served_by_a_scorer_process(model_dir, tmp_path):
  """`streamrl scorer --stage judge` on a free port, and once it listens `streamrl train` with the judge bound to it,
  2 async steps: every row has the judge's rewards, and the scorer scored every sample."""
  config = write_config(tmp_path / "judge.gin", steps=2, mode="async")
  sets = ["--set", "WorkflowConfig.graph='judge'", "--set", f"WorkflowConfig.judge='{model_dir}'"]
  address_file, log_file = tmp_path / "address", tmp_path / "scorer.log"
  with log_file.open("w") as log:
    scorer = subprocess.Popen([sys.executable, "-m", "streamrl_jax.cli", "scorer", "--config", config, *sets,
                               "--stage", "judge", "--listen", "127.0.0.1:0", "--address-file", str(address_file)],
                              env={**os.environ, "XLA_FLAGS": xla_flags()}, stdout=log, stderr=subprocess.STDOUT)
  run = None
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not address_file.exists():  # written once it listens
      assert scorer.poll() is None and time.monotonic() < deadline, log_file.read_text()
      time.sleep(0.2)
    bound = ["--set", f"WorkflowConfig.pools=('far={address_file.read_text()}',)", "--set",
             "WorkflowConfig.bind=('judge=far',)"]
    run = train(tmp_path / "run", "--config", config, *sets, *bound)
    out, _ = run.communicate(timeout=TIMEOUT_S)
    assert run.returncode == 0, out
    scorer.send_signal(signal.SIGTERM)  # as a launcher stops it
    scorer.wait(timeout=60)
  finally:
    for proc in (run, scorer):
      if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
  log = log_file.read_text()
  assert scorer.returncode == 0, log
  rows = metrics(tmp_path / "run")
  assert len(rows) == 2 and all(0 <= r["stage/judge_rewards"] <= 1 for r in rows), rows
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["counters"]["samples_trained"] == 16
  assert "scoring stage 'judge' (judge) on 127.0.0.1:" in log and "(16 rows, 0 refused)" in log, log
