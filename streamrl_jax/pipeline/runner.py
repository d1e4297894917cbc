"""The four run modes from one loop: a sampler thread streams finished groups into the host queue, the
trainer consumes them and publishes weights; a version gate decides how far generation may run ahead.

  colocated      one mesh; generation of step j needs version j; training waits for the whole batch
  disaggregated  two meshes; as colocated, across meshes, with a weight sync per step
  stream         two meshes; the trainer takes each group as it arrives (dynamic-batch pipelining);
                 generation of step j still needs version j, so training stays on-policy
  async          two meshes; generation of step j needs version >= j - staleness and picks up newer
                 weights between decode steps; the trainer streams as in `stream`

Every mode dispatches a step's requests over the sampler replicas by `SchedulingConfig` (random + FIFO, or
the output-length ranker's skew-aware plan), and may add or retire a replica between decode steps.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.config import MeshShape
from streamrl_jax.meshes import build_meshes, mesh_from_devices
from streamrl_jax.models import state_shardings
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.pipeline.groups import GroupCollector
from streamrl_jax.sampling import DecodeEngine, StreamingSampler, fifo_order, split_mesh
from streamrl_jax.scheduling import (OnlineRanker, dispatch_requests, elastic_target, engine_slots,
                                     lengths_from_scores, longest_first_admission, ranking_metrics)
from streamrl_jax.streaming import QueueClosed, SampleQueue, WeightSync
from streamrl_jax.training import MicroBatcher, Trainer, compute_advantages
from streamrl_jax.types import SamplingParams


@dataclasses.dataclass
class RunResult:
  params: nnx.State
  metrics: list[dict]
  counters: dict
  timeline: dict  # name -> list of (start, end, label) busy intervals, seconds from the run's start


def _meshes(config: PipelineConfig, devices):
  devices = list(jax.devices() if devices is None else devices)
  if config.mode == "colocated":
    return (mesh_from_devices(devices, MeshShape(len(devices), 1, 1)),
            mesh_from_devices(devices, MeshShape(1, len(devices), 1)))
  return build_meshes(config.mesh, devices)


class _Run:
  """Shared state of one run: the parts, the version gate, counters and the timeline."""

  def __init__(self, config, model, tokenizer, task, devices, params=None, checkpointer=None, resume=False):
    self.config, self.tokenizer, self.task = config, tokenizer, task
    graphdef, initial = nnx.split(model)
    params = initial if params is None else params
    sampler_mesh, trainer_mesh = _meshes(config, devices)
    self.trainer = Trainer(graphdef, config.optimizer, config.objective, trainer_mesh)
    self.state = self.trainer.init_state(params, seed=config.seed)
    self.start_step = 0
    if resume:
      if checkpointer is None or checkpointer.latest_step() is None:
        raise FileNotFoundError("resume asked for, but there is no checkpoint to resume from")
      self.state, extra = checkpointer.restore(self.state)
      self.start_step = int(extra["next_step"])
    self.checkpointer = checkpointer
    sched = config.scheduling
    self.ranker = OnlineRanker(sched.ranker, sampler_mesh) if sched.policy == "skew_aware" else None
    if resume and self.ranker is not None:
      try:
        self.ranker.load_state_arrays(checkpointer.restore_aux({"ranker": self.ranker.state_arrays()})["ranker"])
      except FileNotFoundError as err:  # saved by a run without the ranker: it starts fresh and learns online
        warnings.warn(f"{err}; the output-length ranker starts untrained", stacklevel=2)
    self._graphdef, self._model_config = graphdef, model.config
    self.replica_meshes = _replica_meshes(sampler_mesh, sched.instance_limit)
    self._engines: dict[tuple[int, int], DecodeEngine] = {}
    self.target_instances = sched.instances
    self.spare_meshes = list(range(sched.instances, sched.instance_limit))[::-1]  # replicas join in mesh order
    admission = longest_first_admission if sched.policy == "skew_aware" else fifo_order
    self.sampler = StreamingSampler([self.engine_for(k) for k in range(sched.instances)], self.state.params,
                                    version=self.start_step, admission=admission, seed=config.seed)
    self.mesh_of = {i: i for i in range(sched.instances)}  # sampler instance id -> replica mesh index
    self.ranker_metrics: dict[int, dict] = {}
    self.generation_s: dict[int, float] = {}
    self.batcher = MicroBatcher(self.trainer, chunk_rows=config.chunk_rows)
    dtype = jnp.dtype(config.sync_dtype) if config.sync_dtype else None
    self.sync = WeightSync(state_shardings(params, sampler_mesh), cast_dtype=dtype)
    self.queue = SampleQueue(config.queue_capacity)
    self.start = time.perf_counter()
    self.timeline = {"sampler": [], "trainer": [], "sync": []}
    self.counters = dict(prompts_submitted=0, samples_generated=0, samples_trained=0, stale_samples=0,
                         sampler_wait_s=0.0, trainer_wait_s=0.0)
    self.error: BaseException | None = None
    self.stop = threading.Event()

  def now(self) -> float:
    return time.perf_counter() - self.start

  def engine_for(self, mesh_index: int, slots: int | None = None) -> DecodeEngine:
    """The engine of replica mesh `mesh_index` compiled for `slots` (default: EngineConfig.num_slots)."""
    slots = slots or self.config.engine.num_slots
    key = (mesh_index, slots)
    if key not in self._engines:
      engine_config = dataclasses.replace(self.config.engine, num_slots=slots)
      self._engines[key] = DecodeEngine(self._graphdef, self._model_config, engine_config,
                                        self.replica_meshes[mesh_index])
    return self._engines[key]


def _replica_meshes(sampler_mesh, replicas: int) -> list:
  """The sampler mesh itself for one replica; else `replicas` equal disjoint sub-meshes of it."""
  if replicas == 1:
    return [sampler_mesh]
  if sampler_mesh.devices.size % replicas:
    raise ValueError(f"SchedulingConfig.max_instances={replicas} does not divide the {sampler_mesh.devices.size} "
                     f"sampler devices")
  return split_mesh(sampler_mesh, [sampler_mesh.devices.size // replicas] * replicas)


def _apply_elastic(run: _Run) -> None:
  """Adds or retires replicas (between decode steps) until the target count takes requests; a retired
  replica finishes its in-flight requests first and its queued ones move to the others."""
  sampler = run.sampler
  while len(sampler.instance_ids) < run.target_instances and run.spare_meshes:
    mesh_index = run.spare_meshes.pop()
    run.mesh_of[sampler.add_instance(run.engine_for(mesh_index))] = mesh_index
  while len(sampler.instance_ids) > max(1, run.target_instances):
    last = sampler.instance_ids[-1]
    sampler.retire_instance(last)
    run.spare_meshes.append(run.mesh_of.pop(last))


def _submit_step(run: _Run, step: int, encoded: list, knobs: SamplingParams) -> np.ndarray | None:
  """Dispatches one step's requests (group_size per prompt) over the replicas; returns the ranker's
  scores per prompt (None without a ranker)."""
  config, sampler, group = run.config, run.sampler, run.config.group_size
  scores = predicted = None
  history = run.ranker.history_lengths if run.ranker is not None else ()
  if run.ranker is not None:
    scores = run.ranker.scores(encoded)
    predicted = lengths_from_scores(scores, history, default=config.max_new_tokens / 2)
  per_request = np.repeat(predicted if predicted is not None else np.zeros(len(encoded)), group)
  dispatch = dispatch_requests(config.scheduling, per_request.tolist(), history, sampler.instance_ids,
                               config.engine.num_slots, seed=config.seed * 100_003 + step)
  if config.scheduling.resize_engines:  # between steps every replica is idle
    for instance_id, batch in dispatch.slot_limits.items():
      slots = engine_slots(batch, config.engine.num_slots)
      sampler.replace_engine(instance_id, run.engine_for(run.mesh_of[instance_id], slots))
  sampler.set_slot_limits(dispatch.slot_limits)
  single = dataclasses.replace(knobs, num_samples=1)
  first_id = step * config.prompts_per_step
  for requests in dispatch.plan.assignment:
    for r in requests:
      i, k = divmod(r, group)
      sampler.submit(encoded[i], single, group_id=first_id + i, instance=dispatch.instance_of[r],
                     predicted_length=None if predicted is None else float(predicted[i]), first_sample_index=k)
  return scores


def _sampler_loop(run: _Run) -> None:
  config, sampler = run.config, run.sampler
  try:
    for step in range(run.start_step, config.steps):
      rng = np.random.default_rng([config.seed, step])  # a step's prompts depend on the step alone: resumable
      waited = time.perf_counter()
      while not run.stop.is_set():
        latest = run.sync.latest()
        version = latest[1] if latest else run.start_step
        if version >= step - config.max_staleness:
          break
        time.sleep(0.002)
      run.counters["sampler_wait_s"] += time.perf_counter() - waited
      if run.stop.is_set():
        return
      if latest and latest[1] > sampler.version:
        sampler.update_params(latest[0], latest[1])
      collector = GroupCollector(config.group_size, run.tokenizer, run.task.reward,
                                 width=config.engine.max_prompt_length + config.max_new_tokens)
      knobs = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                             stop_token_ids=(run.tokenizer.eos_id,), num_samples=config.group_size)
      _apply_elastic(run)
      prompts = [run.task.sample(rng)[0] for _ in range(config.prompts_per_step)]
      encoded = [run.tokenizer.encode(p) for p in prompts]
      first_id = step * config.prompts_per_step
      for i, prompt in enumerate(prompts):
        collector.expect(first_id + i, prompt)
      begin = run.now()
      scores = _submit_step(run, step, encoded, knobs)
      run.counters["prompts_submitted"] += len(prompts)
      lengths, left = np.zeros(len(prompts)), config.samples_per_step
      while sampler.has_work() and not run.stop.is_set():
        _apply_elastic(run)
        if config.mode == "async":
          latest = run.sync.latest()
          if latest and latest[1] > sampler.version:
            sampler.update_params(latest[0], latest[1])
        for sample in sampler.step():
          run.counters["samples_generated"] += 1
          lengths[sample.group_id - first_id] += sample.num_tokens / config.group_size
          left -= 1
          if left == 0:  # the step's last sample: its metrics are in place before the trainer can finish it
            run.generation_s[step] = run.now() - begin
            run.ranker_metrics[step] = _observe_lengths(run, step, encoded, scores, lengths)
          shard = collector.add(sample)
          if shard is not None:
            run.queue.put(shard)
      run.timeline["sampler"].append((begin, run.now(), f"step {step}"))
  except BaseException as err:
    if not (isinstance(err, QueueClosed) and run.stop.is_set()):  # a stop closes the queue under a put
      run.error = err
  finally:
    run.queue.close()


def _observe_lengths(run: _Run, step: int, encoded: list, scores, lengths: np.ndarray) -> dict:
  """Ranks this step's scores (made before it ran) against its realised mean lengths, then feeds them to
  the ranker."""
  out = dict(sampler_instances=len(run.sampler.instance_ids), generation_s=run.generation_s[step])
  if run.ranker is None:
    return out
  if len(lengths) >= 2:
    out.update({f"ranker_{k}": v for k, v in ranking_metrics(scores, lengths).items()})
  run.ranker.observe(encoded, lengths)
  out["ranker_train_steps"] = run.ranker.counters["train_steps"]
  return out


def _take_step(run: _Run, step: int) -> tuple[list, float]:
  """Shards of one global batch; streamed modes accumulate each on arrival. Returns (shards, wait s)."""
  config, needed, shards, waited = run.config, run.config.samples_per_step, [], 0.0
  streamed = config.mode in ("stream", "async")
  while needed > 0:
    start = time.perf_counter()
    try:
      shard = run.queue.get()
    except QueueClosed:
      raise RuntimeError(f"the sampler stopped before step {step} was complete") from run.error
    waited += time.perf_counter() - start
    needed -= shard.num_samples
    shards.append(shard)
    if streamed:
      _accumulate(run, shard, step)
  if not streamed:
    for shard in shards:
      _accumulate(run, shard, step)
  return shards, waited


def _accumulate(run: _Run, shard, step: int) -> None:
  begin = run.now()
  stale = step - shard.first_versions
  run.counters["stale_samples"] += int(np.sum(stale > run.config.max_staleness))
  advantages = compute_advantages(run.config.advantage, shard.rewards, shard.group_ids)
  run.state = run.batcher.add(run.state, shard.train_batch(advantages))
  run.counters["samples_trained"] += shard.num_samples
  run.timeline["trainer"].append((begin, run.now(), f"step {step}"))


def run_pipeline(config: PipelineConfig, model, tokenizer, task, *, devices=None, params=None,
                 on_step: Callable[[dict], None] | None = None, checkpointer=None, resume: bool = False) -> RunResult:
  """Runs RL steps up to `config.steps`; returns the trained parameters, per-step metrics, counters, timeline.

  With a `Checkpointer`, the trainer state is saved after every step (asynchronously); `resume=True`
  restores the latest one and continues with the next step. Samples generated for a step that was not
  trained yet (in flight at a stop) are generated again on resume: no prompt is skipped or trained twice.
  """
  run = _Run(config, model, tokenizer, task, devices, params, checkpointer, resume)
  thread = threading.Thread(target=_sampler_loop, args=(run,), daemon=True, name="sampler")
  thread.start()
  if run.ranker is not None:
    run.ranker.start()
  metrics, last_end = [], run.now()
  try:
    for step in range(run.start_step, config.steps):
      first_entry = len(run.timeline["trainer"])
      shards, waited = _take_step(run, step)
      begin = run.now()
      run.state, train_metrics = run.batcher.finish(run.state)
      run.timeline["trainer"].append((begin, run.now(), f"update {step}"))
      train_s = sum(e - b for b, e, _ in run.timeline["trainer"][first_entry:])  # this step's accumulate + update
      run.target_instances = elastic_target(config.scheduling, len(run.sampler.instance_ids),
                                            run.generation_s.get(step, 0.0), train_s)  # before the weights go out
      sync_start = run.now()
      run.sync.push(run.state.params, step + 1)
      if run.checkpointer is not None:
        aux = {"ranker": run.ranker.state_arrays()} if run.ranker is not None else None
        run.checkpointer.save(run.state, extra={"next_step": step + 1}, aux=aux)
      run.timeline["sync"].append((sync_start, sync_start, f"v{step + 1}"))
      run.counters["trainer_wait_s"] += waited
      end = run.now()
      metrics.append(_step_metrics(run, step, shards, train_metrics, waited, end - last_end))
      last_end = end
      if on_step is not None:
        on_step(metrics[-1])
  finally:
    run.stop.set()
    run.queue.close()
    thread.join()
    run.sync.wait()
    if run.ranker is not None:
      run.ranker.stop()
    if run.checkpointer is not None:
      run.checkpointer.wait()
  if run.error is not None:
    raise RuntimeError("sampler thread failed") from run.error
  params = jax.tree.map(np.asarray, run.state.params)
  return RunResult(params, metrics, dict(run.counters, **{f"queue_{k}": v for k, v in run.queue.stats().items()}),
                   run.timeline)


def _step_metrics(run: _Run, step: int, shards, train: dict, waited: float, wall: float) -> dict:
  rewards = np.concatenate([s.rewards for s in shards])
  versions = np.concatenate([s.first_versions for s in shards])
  seconds = [v for k, v in sorted(run.sync.seconds.items())]
  return dict(step=step + 1, reward_mean=float(rewards.mean()), accuracy=float(np.mean(rewards >= 1.0)),
              samples_per_s=len(rewards) / max(wall, 1e-9), staleness_mean=float(np.mean(step - versions)),
              staleness_max=int(np.max(step - versions)), trainer_idle_frac=min(1.0, waited / max(wall, 1e-9)),
              sampler_idle_frac=min(1.0, run.counters["sampler_wait_s"] / max(run.now(), 1e-9)),
              weight_sync_s=float(seconds[-1]) if seconds else 0.0, step_s=wall, **run.ranker_metrics.get(step, {}),
              **train)
