"""The trainer and samplers joined by Arrow Flight on loopback (threads of this process, each role on its own
devices): every prompt trained once in each mode, stream equals in-process disaggregated. Two samplers
sharing the steps run as processes in tests/test_gke.py and tests/test_faults.py."""

import dataclasses
import queue
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.meshes import MeshConfig
from streamrl_jax.settings import flat_settings
from streamrl_jax.models import Transformer
from streamrl_jax.pipeline.sampler.program import SamplerEndpoint, run_sampler
from streamrl_jax.pipeline.trainer.program import TrainerEndpoint, serve_training
from streamrl_jax.pipeline.controller.config import ControllerConfig
from streamrl_jax.streaming.flight_config import FlightConfig
from tests.pipeline_setup import BASE, MODEL, TOKENIZER, DigitTask

FAST = FlightConfig(call_timeout_s=30, connect_retry_s=30)
FAST_CONTROL = ControllerConfig(heartbeat_s=0.2, sampler_timeout_s=60, finish_grace_s=5)


def run_remote(mode: str, samplers: int = 1, **overrides):
  """(trainer's RunResult, each sampler's stats): the trainer on devices 4-7, samplers on devices 0-3."""
  config = dataclasses.replace(BASE, mode=mode, mesh=MeshConfig(), controller=FAST_CONTROL, **overrides)
  task, settings = DigitTask(max_digits=3), flat_settings(config)
  addresses, stats, errors = queue.Queue(), [None] * samplers, []

  def sampler(k: int, address: str):
    try:
      devices = np.array_split(np.asarray(jax.devices()[:4]), samplers)[k].tolist()
      endpoint = SamplerEndpoint(address, f"sampler-{k}", flight_config=FAST, settings=settings)
      stats[k] = run_sampler(config, MODEL, TOKENIZER, task, endpoint=endpoint, devices=devices)
    except BaseException as err:
      errors.append(err)

  def listening(address: str):
    for k in range(samplers):
      threading.Thread(target=sampler, args=(k, address), daemon=True, name=f"sampler-{k}").start()

  result = serve_training(config, Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER, task, settings=settings,
                          endpoint=TrainerEndpoint(flight_config=FAST, on_listening=listening),
                          devices=jax.devices()[4:])
  for thread in [t for t in threading.enumerate() if t.name.startswith("sampler-")]:
    thread.join(timeout=60)
  assert not errors, errors
  return result, stats


@pytest.fixture(scope="module")
def remote():
  return {mode: run_remote(mode) for mode in ("stream", "async")}  # disaggregated: stream without streaming


@pytest.mark.parametrize("mode", ["stream", "async"])
def test_every_prompt_is_trained_once_across_flight(remote, mode):
  result, (stats,) = remote[mode]
  counters = result.counters
  assert counters["prompts_submitted"] == 3 * 4 and counters["leases"] == 3
  assert counters["samples_generated"] == counters["samples_trained"] == 3 * 16 == counters["flight_accepted_samples"]
  assert counters["duplicate_samples"] == 0 and counters["stale_samples"] == 0 and counters["flight_bad_batches"] == 0
  assert stats["put_samples"] == 3 * 16 and stats["weights_fetches"] >= 1
  assert [m["step"] for m in result.metrics] == [1, 2, 3]
  staleness = [m["staleness_max"] for m in result.metrics]
  assert max(staleness) == (1 if mode == "async" else 0)
  assert {"sampler-0", "trainer", "sync"} <= set(result.timeline) and result.timeline["sampler-0"]


def test_stream_across_flight_ends_with_the_parameters_of_in_process_disaggregated(remote):
  from tests.pipeline_setup import run
  local = run("disaggregated")
  for x, y in zip(jax.tree.leaves(remote["stream"][0].params), jax.tree.leaves(local.params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_colocated_is_one_program_and_a_sampler_is_one_process(capsys):
  from streamrl_jax import cli
  with pytest.raises(ValueError, match="colocated.*one program"):
    serve_training(dataclasses.replace(BASE, mode="colocated"), Transformer(MODEL, rngs=nnx.Rngs(0)), TOKENIZER,
                   DigitTask(max_digits=3))
  assert cli.main(["sampler", "--connect", "127.0.0.1:1", "--coordinator", "127.0.0.1:2", "--num-processes", "2",
                   "--process-id", "0"]) == 2
  assert "a sampler runs in one process" in capsys.readouterr().err


class _BeatUntilAborted:
  """A control whose heartbeat retries against a trainer that is gone until the session's end abandons it."""

  def __init__(self):
    self.beating = threading.Event()

  def heartbeat(self, message, abort=None):
    self.beating.set()
    abort.wait(30)
    raise ConnectionError("a call abandoned: the session it served has ended")


def test_a_beat_abandoned_at_the_sessions_end_neither_stops_the_sampler_nor_counts_as_an_error():
  """A session ending for a rejoin (a restarted trainer no longer knows the sampler) while its heartbeat retried:
  the sampler registers again rather than taking the abandoned beat for the run's end."""
  from streamrl_jax.pipeline.sampler.program import _heartbeat

  control, errors = _BeatUntilAborted(), []
  stop, ended, rejoin = threading.Event(), threading.Event(), threading.Event()
  beat = threading.Thread(target=_heartbeat, args=(control, 1, 0.01, stop, ended, rejoin, errors))
  beat.start()
  assert control.beating.wait(30)
  ended.set()
  beat.join(30)
  assert not beat.is_alive() and not stop.is_set() and errors == []
