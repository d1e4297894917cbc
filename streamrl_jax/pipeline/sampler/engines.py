"""A sampler worker's engines: one per instance sub-mesh and compiled slot count, which engine instance runs on
which mesh as instances join and retire (elastic), and a lease's requests dispatched over the instances."""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.meshes import instance_meshes
from streamrl_jax.messages import Lease
from streamrl_jax.models import ModelConfig
from streamrl_jax.run_shape import RunShape
from streamrl_jax.sampling import DecodeEngine, EngineConfig, make_engine
from streamrl_jax.scheduling import SchedulingConfig, dispatch_requests, engine_slots
from streamrl_jax.types import SamplingParams


class InstanceEngines:
  """The compiled engines (kept across rejoins) and the instances' meshes: the target count, each running
  instance's mesh and the spare ones (reset with the sampler). `scheduling` sets the instances and how a lease's
  requests are dispatched over them; `engine` is each engine's config (its `num_slots` the full size)."""

  def __init__(self, scheduling: SchedulingConfig, engine: EngineConfig, graphdef, model_config: ModelConfig, mesh):
    self.scheduling, self.engine = scheduling, engine
    self._graphdef, self._model_config = graphdef, model_config
    self.meshes = instance_meshes(mesh, scheduling.instance_limit)
    self._engines: dict[tuple[int, int], DecodeEngine] = {}
    self.reset()

  def reset(self) -> None:
    """No instance running: `SchedulingConfig.instances` wanted, every other mesh spare."""
    sched = self.scheduling
    self.mesh_of: dict[int, int] = {}  # sampler instance id -> instance mesh index
    self.spare = list(range(sched.instances, sched.instance_limit))[::-1]  # instances join in mesh order
    self.target = sched.instances

  def engine_for(self, mesh_index: int, slots: int | None = None) -> DecodeEngine:
    """The engine of instance mesh `mesh_index` compiled for `slots` (default: EngineConfig.num_slots)."""
    slots = slots or self.engine.num_slots
    if (mesh_index, slots) not in self._engines:
      engine_config = dataclasses.replace(self.engine, num_slots=slots)
      self._engines[(mesh_index, slots)] = make_engine(self._graphdef, self._model_config, engine_config,
                                                       self.meshes[mesh_index])
    return self._engines[(mesh_index, slots)]

  def first(self) -> list[DecodeEngine]:
    """A new sampler's engines: instance i on mesh i, as many as the target."""
    engines = [self.engine_for(k) for k in range(self.target)]
    self.mesh_of = {i: i for i in range(len(engines))}
    return engines

  def apply_elastic(self, sampler) -> None:
    """Adds or retires `sampler`'s engine instances (between decode steps) until the target count takes requests; a
    retired instance finishes its in-flight requests first and its queued ones move to the others."""
    while len(sampler.instance_ids) < self.target and self.spare:
      mesh_index = self.spare.pop()
      self.mesh_of[sampler.add_instance(self.engine_for(mesh_index))] = mesh_index
    while len(sampler.instance_ids) > max(1, self.target):
      last = sampler.instance_ids[-1]
      sampler.retire_instance(last)
      self.spare.append(self.mesh_of.pop(last))


def submit_lease(shape: RunShape, sampler, engines: InstanceEngines, lease: Lease, encoded: list, stop_ids) -> None:
  """Dispatches the lease's requests (group_size per prompt, `encoded` its prompts' token ids) over `sampler`'s
  engine instances by `engines.scheduling`; samples begun elsewhere resume after their tokens, finished ones are
  not submitted."""
  group, scheduling, num_slots = shape.group_size, engines.scheduling, engines.engine.num_slots
  predicted = np.asarray(lease.predicted_lengths, float) if lease.predicted_lengths else None
  per_request = np.repeat(predicted if predicted is not None else np.zeros(len(encoded)), group)
  dispatch = dispatch_requests(scheduling, per_request.tolist(), lease.length_quantiles, sampler.instance_ids,
                               num_slots, seed=shape.seed * 100_003 + lease.step)
  if scheduling.resize_engines and not sampler.has_work():  # idle between leases (not in flight)
    for instance_id, batch in dispatch.slot_limits.items():
      slots = engine_slots(batch, num_slots)
      sampler.replace_engine(instance_id, engines.engine_for(engines.mesh_of[instance_id], slots))
  sampler.set_slot_limits(dispatch.slot_limits)
  single = SamplingParams(temperature=shape.temperature, max_new_tokens=shape.max_new_tokens,
                          stop_token_ids=stop_ids, num_samples=1, top_k=shape.top_k,
                          top_p=shape.top_p, min_p=shape.min_p)
  begun = {(p.group_id, p.sample_index): p for p in lease.partials}
  for requests in dispatch.plan.assignment:
    for r in requests:
      i, k = divmod(r, group)
      partial = begun.get((lease.group_ids[i], k))
      if partial is not None and partial.finished:
        continue  # scored as it is (the worker's `_start`)
      sampler.submit(encoded[i], single, group_id=lease.group_ids[i], instance=dispatch.instance_of[r],
                     predicted_length=None if predicted is None else float(predicted[i]), first_sample_index=k,
                     progress=partial)
