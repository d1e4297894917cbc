"""The trainer's door under fire: a hostile client fuzzes a live trainer's Flight server while an honest sampler
feeds it, and the run must end as a clean run does.

Two runs of the same tiny on-policy configuration (`stream`, a trainer and one honest sampler process on
loopback). In the second, a client of this program registers with the trainer's settings (it takes no lease)
and sends hypothesis-generated malformed input: sample batches mutated around the schema (non-finite and
impossible log-probabilities and rewards, nulls at both levels, token ids outside the vocabulary, samples
longer or batches larger than the run allows, steps mixed, groups not whole, the honest sampler's groups,
far-off steps, columns retyped or missing, envelopes broken), control messages of every type with fields
drawn at random (NaN and infinities, huge numbers, long strings, wrong types) and weight tickets. Most is
sent before the honest sampler starts (the trainer waits at step 0), the rest while it trains.

Figures: `trainer_exits` (1 when the fuzzed trainer exited non-zero), `nonfinite_params` (in its final
weights), `acked_then_dropped` (fuzz batches acknowledged as accepted, plus samples the trainer dropped after
the door took them), `rss_growth_frac` (the fuzzed trainer's peak resident memory over the clean one's,
minus 1), `weights_equal` (final weights of both runs equal within rtol 1e-4, atol 1e-6: the honest samples
alone were trained, only their arrival order may differ) and `max_abs_param_diff`. Prints one JSON object
as its last line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import Run  # noqa: E402
from sizing import size  # noqa: E402

from streamrl_jax.message_codec import MESSAGES  # noqa: E402
from streamrl_jax.messages import Heartbeat, Leave, Register  # noqa: E402
from streamrl_jax.streaming import SampleShard  # noqa: E402
from streamrl_jax.streaming.flight_client import FlightConnection, FlightControl  # noqa: E402
from streamrl_jax.streaming.flight_server import SAMPLES_COMMAND  # noqa: E402
from streamrl_jax.streaming.sample_schema import SampleEnvelope, shard_to_batch  # noqa: E402

STEPS, PROMPTS, GROUP, NEW_TOKENS, PROMPT_LENGTH = size(8, 3), 4, 2, 8, 16
SETS = ("MeshConfig.sampler_devices=1", "MeshConfig.trainer_devices=1", "JobConfig.warmup_steps=0",
        "JobConfig.eval_prompts=2", "DemoModelConfig.hidden_size=32", f"PipelineConfig.steps={STEPS}",
        "PipelineConfig.mode='stream'", f"PipelineConfig.prompts_per_step={PROMPTS}",
        f"PipelineConfig.group_size={GROUP}", f"PipelineConfig.max_new_tokens={NEW_TOKENS}",
        "EngineConfig.num_slots=8", f"PipelineConfig.max_new_tokens={NEW_TOKENS}",
        f"EngineConfig.max_prompt_length={PROMPT_LENGTH}", "ControllerConfig.heartbeat_s=0.5",
        "ControllerConfig.lease_timeout_s=3.0")
SHARDS, MESSAGES_SENT, TICKETS = 700, 300, 60
BEFORE_SAMPLER = 0.8  # the share of each kind sent before the honest sampler starts
WIDTH = PROMPT_LENGTH + NEW_TOKENS


def _run_settings(run: Run) -> tuple[dict, int]:
  """The trainer's settings (what a sampler registers with) and its vocabulary size."""
  from streamrl_jax import gin_config
  from streamrl_jax.settings import flat_settings

  gin_config.parse([run.config[1]], list(SETS))
  config, job = gin_config.build_run()
  model_config, _ = job.model_spec()
  return flat_settings(config.resolved(job.dtype()), job), model_config.vocab_size  # as `streamrl trainer` resolves


# ---- what the fuzzer sends ------------------------------------------------------------------------------
def _groups(step: int, group_ids, rng: np.random.Generator, lengths=None) -> SampleShard:
  rows = [(g, i) for g in group_ids for i in range(GROUP)]
  n = len(rows)
  lengths = np.asarray(lengths if lengths is not None else rng.integers(3, WIDTH + 1, n))
  width = int(lengths.max())
  valid = np.arange(width)[None] < lengths[:, None]
  return SampleShard(tokens=rng.integers(0, 20, (n, width)) * valid, valid=valid,
                     loss_mask=valid & (np.arange(width)[None] >= 2), logprobs=-rng.random((n, width)) * valid,
                     rewards=rng.random(n), group_ids=[g for g, _ in rows],
                     sample_indices=[i for _, i in rows], steps=np.full(n, step), first_versions=np.zeros(n),
                     last_versions=np.zeros(n))


def _replace(batch: pa.RecordBatch, name: str, values) -> pa.RecordBatch:
  fields = [pa.field(name, values.type) if f.name == name else f for f in batch.schema]
  return pa.record_batch([values if f.name == name else batch.column(i) for i, f in enumerate(batch.schema)],
                         schema=pa.schema(fields, metadata=batch.schema.metadata))


def _set_value(batch, column: str, draw, value):
  values = batch.column(column).to_pylist()
  row = draw(st.integers(0, len(values) - 1))
  if isinstance(values[row], list):
    values[row][draw(st.integers(0, len(values[row]) - 1))] = value
  else:
    values[row] = value
  return _replace(batch, column, pa.array(values, batch.schema.field(column).type))


def _mutations(vocab: int):
  """name -> (draw, batch, step) -> batch: each breaks one rule of the schema or of the leases."""
  special = st.sampled_from([math.nan, math.inf, -math.inf, -1e30, 1e30, 5.0])
  return {
      "logprob": lambda d, b, s: _set_value(b, "logprobs", d, d(special)),
      "reward": lambda d, b, s: _set_value(b, "reward", d, d(st.sampled_from([math.nan, math.inf, -1e30]))),
      "inner_null": lambda d, b, s: _set_value(b, d(st.sampled_from(["tokens", "loss_mask", "logprobs"])), d,
                                               None),
      "null": lambda d, b, s: _set_value(b, d(st.sampled_from(["step", "group_id", "sample_index", "reward", "tokens"])),
                                         d, None),
      "token_id": lambda d, b, s: _set_value(b, "tokens", d, d(st.sampled_from([vocab, vocab + 7, -1, 2**31 - 1]))),
      "foreign": lambda d, b, s: b,  # the honest sampler's groups, well formed
      "far_step": lambda d, b, s: _replace(b, "step", pa.array([s + d(st.integers(1, 10**6))] * b.num_rows, pa.int64())),
  }


def _whole_batch_mutations(rng, step: int, sampler_id: int, vocab: int):
  """Mutations that need the batch built differently: name -> (draw) -> batch."""
  first = step * PROMPTS
  good = lambda groups, **kw: shard_to_batch(_groups(step, groups, rng, **kw), SampleEnvelope(sampler_id, 0))  # noqa: E731
  return {
      "too_long": lambda d: good([first], lengths=[WIDTH + d(st.integers(1, 100_000)), 4]),
      "too_many_rows": lambda d: shard_to_batch(SampleShard.concat([_groups(step, [first], rng)] * (PROMPTS + 1)),
                                                SampleEnvelope(sampler_id, 0)),
      "mixed_steps": lambda d: _replace(good([first, first + 1]), "step",
                                        pa.array([step, step, step + 1, step + 1], pa.int64())),
      "partial_group": lambda d: _replace(good([first]), "sample_index", pa.array([0, 0], pa.int64())),
      "lengths_differ": lambda d: _replace(good([first]), "loss_mask", pa.array([[False] * 2, [False] * 3],
                                                                                 pa.list_(pa.bool_()))),
      "retyped": lambda d: _replace(good([first]), "reward", pa.array([1, 2], pa.int64())),
      "no_metadata": lambda d: good([first]).replace_schema_metadata({}),
      "seq_differs": lambda d: _replace(good([first]), "seq", pa.array([0, 1], pa.int64())),
      "first_token_loss": lambda d: _first_token_loss(good([first])),
      "versions": lambda d: _replace(good([first]), "last_version", pa.array([-5, -5], pa.int64())),
  }


def _first_token_loss(batch: pa.RecordBatch) -> pa.RecordBatch:
  lengths = np.diff(batch.column("tokens").offsets.to_numpy())
  return _replace(batch, "loss_mask", pa.array([[True] + [False] * (n - 1) for n in lengths], pa.list_(pa.bool_())))


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(-10, 10)
                     | st.sampled_from([math.nan, math.inf, -math.inf, 1e9, 1e300]) | st.text(max_size=40)
                     | st.integers(300, 100_000).map(lambda n: "x" * n),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=8)


# A field's value: mostly of a plausible shape (a number of any size or sign, NaN and infinities among them,
# a string, a list of numbers), else anything JSON holds.
_NUMBER = (st.integers(-2**70, 2**70) | st.floats(-1e3, 1e3)
           | st.sampled_from([math.nan, math.inf, -math.inf, 1e9, 1e300, -1.0, 0, 2**63]))
_FIELD = st.one_of(_NUMBER, _NUMBER, st.text(max_size=40), st.lists(_NUMBER, max_size=5),
                   st.lists(st.lists(_NUMBER, max_size=3), max_size=3), st.booleans(), _JSON)


class Fuzzer:
  """A client of the trainer that registers (and heartbeats, and leaves when the run ends) but takes no
  lease, and sends malformed input; counts what came back."""

  def __init__(self, address: str, settings: dict, vocab: int):
    self.connection = FlightConnection(address, timeout_s=10, retry_s=300)
    self.control = FlightControl(self.connection)
    self.sampler_id = self.control.register(Register("fuzzer", settings)).sampler_id
    self.vocab = vocab
    self.counts = dict(shards_sent=0, shards_refused=0, shards_not_taken=0, shards_accepted=0, messages_sent=0,
                       messages_refused=0, tickets_sent=0, tickets_refused=0, other_errors=0)
    self.examples: dict[str, str] = {}
    self._stop = threading.Event()
    self._beat = threading.Thread(target=self._heartbeat, daemon=True)
    self._beat.start()

  def _heartbeat(self) -> None:
    while not self._stop.wait(0.5):
      try:
        if self.control.heartbeat(Heartbeat(self.sampler_id)).stop:
          self.control.leave(Leave(self.sampler_id))
          return
      except Exception:  # the trainer is gone: the run is over
        return

  def close(self) -> None:
    self._stop.set()
    try:
      self.control.leave(Leave(self.sampler_id))
    except Exception:
      pass
    self.connection.close()

  def _step(self) -> int:
    from streamrl_jax.messages import VersionInfo, VersionQuery
    return max(0, min(STEPS - 1, self.connection.action(VersionQuery(0, 0.0), VersionInfo).version))

  def put(self, name: str, batch: pa.RecordBatch) -> None:
    self.counts["shards_sent"] += 1
    try:
      writer, reader = self.connection.client.do_put(flight.FlightDescriptor.for_command(SAMPLES_COMMAND),
                                                     batch.schema, options=flight.FlightCallOptions(timeout=10))
      with writer:
        writer.write_batch(batch)
        writer.done_writing()
        status = json.loads(reader.read().to_pybytes())["status"]
      self.counts["shards_accepted" if status == "accepted" else "shards_not_taken"] += 1
    except flight.FlightServerError as err:
      self.counts["shards_refused"] += 1
      self.examples.setdefault(name, str(err).split(". Detail")[0][:160])
    except Exception as err:  # noqa: BLE001 - whatever else came back is counted and shown
      self.counts["other_errors"] += 1
      self.examples.setdefault(f"{name} (other)", f"{type(err).__name__}: {str(err)[:160]}")

  def shards(self, n: int) -> None:
    mutations = _mutations(self.vocab)

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
      step = self._step()  # what the trainer is at: only an offset, never a bound of a draw
      rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
      names = sorted(mutations) + sorted(_whole_batch_mutations(rng, step, self.sampler_id, self.vocab))
      name = data.draw(st.sampled_from(names), label="mutation")
      sender = data.draw(st.sampled_from([self.sampler_id, self.sampler_id, 12345]), label="sampler id")
      if name in mutations:
        offsets = data.draw(st.lists(st.integers(0, PROMPTS - 1), min_size=1, max_size=2, unique=True))
        batch = shard_to_batch(_groups(step, [step * PROMPTS + k for k in offsets], rng), SampleEnvelope(sender, 0))
        batch = mutations[name](data.draw, batch, step)
      else:
        batch = _whole_batch_mutations(rng, step, sender, self.vocab)[name](data.draw)
      self.put(name, batch)
    one()

  def messages(self, n: int) -> None:
    types = sorted(MESSAGES)

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
      kind = data.draw(st.sampled_from(types + ["Nonsense"]), label="type")
      names = [f.name for f in dataclasses.fields(MESSAGES[kind])] if kind in MESSAGES else ["x"]
      fields = {name: data.draw(_FIELD, label=name) for name in names}  # every field, each of any shape
      if data.draw(st.booleans(), label="break the field set"):
        if names:  # a message of no fields (`SamplerWaitQuery`) has none to take away
          fields.pop(data.draw(st.sampled_from(names)), None)
        fields[data.draw(st.sampled_from(["x", "@type2", "wait"]))] = 1
      if fields.get("sampler_id") == self.sampler_id:  # its own id would make a valid lease request
        fields["sampler_id"] = 1
      body = json.dumps({"@type": kind, **fields}).encode()
      self.counts["messages_sent"] += 1
      try:
        list(self.connection.client.do_action(flight.Action("control", body),
                                              options=flight.FlightCallOptions(timeout=15)))
      except flight.FlightServerError as err:
        self.counts["messages_refused"] += 1
        self.examples.setdefault(f"message {kind}", str(err).split(". Detail")[0][:160])
      except Exception as err:  # noqa: BLE001
        self.counts["other_errors"] += 1
        self.examples.setdefault(f"message {kind} (other)", f"{type(err).__name__}: {str(err)[:160]}")
    one()

  def tickets(self, n: int) -> None:
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(ticket=st.fixed_dictionaries({"weights": st.integers(-3, 3) | _JSON},
                                        optional={"part": st.integers(-10, 10**8) | _JSON,
                                                  "parts": st.integers(-10, 10**8) | _JSON}))
    def one(ticket):
      self.counts["tickets_sent"] += 1
      try:
        self.connection.client.do_get(flight.Ticket(json.dumps(ticket).encode()),
                                      options=flight.FlightCallOptions(timeout=15)).read_all()
      except flight.FlightServerError as err:
        self.counts["tickets_refused"] += 1
        self.examples.setdefault("ticket", str(err).split(". Detail")[0][:160])
      except Exception as err:  # noqa: BLE001
        self.counts["other_errors"] += 1
        self.examples.setdefault("ticket (other)", f"{type(err).__name__}: {str(err)[:160]}")
    one()


# ---- the two runs --------------------------------------------------------------------------------------
def _final_weights(workdir: Path) -> dict:
  from safetensors.numpy import load_file
  out = {}
  for path in sorted((workdir / "final_model").glob("*.safetensors")):
    out.update(load_file(str(path)))
  return out


def _trained(workdir: Path, run: Run, fuzz: bool) -> tuple[dict, dict, float, int, dict]:
  run.start("trainer")
  fuzzer = None
  try:
    if fuzz:
      settings_, vocab = _run_settings(run)
      fuzzer = Fuzzer(run.address, settings_, vocab)
      fuzzer.shards(int(SHARDS * BEFORE_SAMPLER))
      fuzzer.messages(int(MESSAGES_SENT * BEFORE_SAMPLER))
      fuzzer.tickets(int(TICKETS * BEFORE_SAMPLER))
    run.start("honest")
    if fuzzer is not None:
      fuzzer.shards(SHARDS - int(SHARDS * BEFORE_SAMPLER))
      fuzzer.messages(MESSAGES_SENT - int(MESSAGES_SENT * BEFORE_SAMPLER))
      fuzzer.tickets(TICKETS - int(TICKETS * BEFORE_SAMPLER))
      fuzzer.close()
    code = run.children["trainer"].proc.wait(timeout=600)
  finally:
    run.kill_all()
  summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
  peak_rss = max((m["rss_mb"] for m in run.metrics()), default=0.0)
  return (_final_weights(workdir) if code == 0 else {}, summary.get("counters", {}), peak_rss, code,
          dict(fuzzer.counts, examples=fuzzer.examples) if fuzzer else {})


def main() -> dict:
  root = Path(tempfile.mkdtemp(prefix="wire_"))
  start = time.perf_counter()
  clean, _, clean_rss, clean_code, _ = _trained(root / "clean", Run(root / "clean", SETS), fuzz=False)
  if clean_code:
    raise RuntimeError(f"the clean run failed ({clean_code}); see {root / 'clean'}")
  fuzzed, counters, fuzzed_rss, code, fuzz = _trained(root / "fuzzed", Run(root / "fuzzed", SETS), fuzz=True)
  diff = max((float(np.abs(fuzzed[k] - clean[k]).max()) for k in clean), default=float("nan")) if fuzzed else None
  equal = bool(fuzzed) and all(np.allclose(fuzzed[k], clean[k], rtol=1e-4, atol=1e-6) for k in clean)
  examples = fuzz.pop("examples", {})
  out = dict(
      fuzz_inputs=fuzz["shards_sent"] + fuzz["messages_sent"] + fuzz["tickets_sent"], **fuzz,
      trainer_exits=int(code != 0),
      nonfinite_params=int(sum(np.sum(~np.isfinite(v)) for v in fuzzed.values())) if fuzzed else None,
      acked_then_dropped=int(fuzz["shards_accepted"] + counters.get("refused_samples", 0)),
      rss_growth_frac=round(fuzzed_rss / clean_rss - 1.0, 4) if clean_rss else None,
      weights_equal=equal, max_abs_param_diff=diff,
      trainer_bad_batches=counters.get("flight_bad_batches"), trainer_bad_actions=counters.get("flight_bad_actions"),
      trainer_bad_tickets=counters.get("flight_bad_tickets"), samples_trained=counters.get("samples_trained"),
      samples_planned=counters.get("samples_planned"), seconds=round(time.perf_counter() - start, 1),
      workdir=str(root))
  print(json.dumps(examples, indent=1), file=sys.stderr)
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
