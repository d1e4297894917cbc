"""What `streamrl plan` and its `--check` processes plan from: the run's gin files and bindings read as `streamrl
train` reads them, and the model's shapes (no weight)."""

from __future__ import annotations


def planned_run(config: list[str], sets: list[str], model: str, platform: str) -> tuple:
  """(plan setup, model shapes, where they came from, the model's spec) of the run `config` and `sets` describe, its
  model `model` (or JobConfig.model), computing in the dtype `platform`'s backend resolves."""
  from streamrl_jax import gin_config
  from streamrl_jax.models.dtype_probe import ProductShapes, choose_compute_dtype
  from streamrl_jax.pipeline.parts import plan_setup
  from streamrl_jax.planning.model_shapes import model_shapes

  gin_config.parse(gin_config.run_files(config), sets)
  run, job = gin_config.build_run()
  spec = model or job.model
  if not spec:
    raise ValueError("plan: name the model (--model: a config.json, a directory, a catalog name or a Hub id), or set "
                     "JobConfig.model in the config")
  shapes, _ = model_shapes(spec, "float32")
  dtype = choose_compute_dtype(job.compute_dtype, ProductShapes.of(shapes), backend=platform).dtype
  shapes, source = model_shapes(spec, dtype)
  return plan_setup(run.resolved(dtype)), shapes, source, spec
