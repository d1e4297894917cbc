"""The trainer's attention alone, compiled for one chip at one device's share of the run's call (its rows of the
packed length, the model's heads), forward and backward, with the fused kernel (`models.fused_attention`) and with
XLA's attention: the temporaries each keeps, the measure of what the kernel saves."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl_jax.meshes import MeshShape, mesh_from_devices
from streamrl_jax.models import ModelConfig
from streamrl_jax.models.fused_attention import AttentionKernel, segment_attention
from streamrl_jax.models.layers import grouped_attention
from streamrl_jax.planning.compiled import program_cost


def attention_temporaries(model: ModelConfig, notes: dict, device) -> dict:
  """{kernel, xla: temporaries in bytes, kernel_over_xla} of one layer's attention gradient at a trainer device's rows
  (`notes`: the trainer side's: call rows over its batch shards, call length) on `device`; {} where the trainer
  computes with XLA's attention anyway (no kernel on this backend)."""
  mesh = mesh_from_devices([device], MeshShape(1, 1, 1))
  if device.platform != "tpu" and notes.get("attention") != "splash":
    return {}
  rows = max(1, notes["call_rows"] // notes.get("batch_shards", 1))
  length, dtype = notes["call_length"], model.compute_dtype
  window = next((w for w in model.windows if w is not None), None)
  q = jax.ShapeDtypeStruct((rows, length, model.num_heads, model.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((rows, length, model.num_kv_heads, model.head_dim), dtype)
  segments = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  kernel = AttentionKernel(mesh, interpret=device.platform != "tpu")

  def fused(q, k, v, ids):
    return jnp.sum(segment_attention(q, k, v, ids, window, kernel).astype(jnp.float32))

  def xla(q, k, v, ids):
    steps = jnp.arange(length)
    attend = (steps[None, :] <= steps[:, None])[None] & (ids[:, None, :] == ids[:, :, None])
    if window is not None:
      attend = attend & ((steps[:, None] - steps[None, :]) < window)[None]
    out = grouped_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), attend)
    return jnp.sum(out.astype(jnp.float32))

  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in (q, kv, kv, segments)]
  out = {}
  for name, fn in (("kernel", fused), ("xla", xla)):
    lowered = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).trace(*args).lower()
    out[name] = program_cost(f"attention.{name}", lowered).temp_bytes
  out["kernel_over_xla"] = round(out["kernel"] / max(out["xla"], 1), 4)
  return out | {"rows": rows, "length": length, "window": window}
