"""The trainer's weights in its low compute dtype, converted once per optimizer step instead of once per call.

On a CPU computing in bfloat16 (`layers.cpu_low_precision`), each trainer call converted every float32 weight to
bfloat16: reading 4 and writing 2 bytes a parameter, about 0.2 s of a SmolLM2 call on a 2-core machine, four calls a
step. `LowCopy` keeps the converted weights beside the state (one conversion after each update) and
`computed_from` hands the model float32 weights whose values are that copy: the model's own conversion to bfloat16
of a float32 that came from bfloat16 is a round trip XLA removes, so the products read the copy, while the gradient
reaches the float32 weights in float32 (never rounded through bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl_jax.launch import shapes_only
from streamrl_jax.models.layers import cpu_low_precision


@jax.custom_vjp
def computed_as(weight: jax.Array, low: jax.Array) -> jax.Array:
  """`low` (the weight rounded to a lower precision) in `weight`'s dtype; the gradient goes to `weight` whole."""
  return low.astype(weight.dtype)


def _computed_as_fwd(weight, low):
  return computed_as(weight, low), None


def _computed_as_bwd(_, g):
  return g, None  # `low` is a copy, not a variable: no gradient


computed_as.defvjp(_computed_as_fwd, _computed_as_bwd)


def _copied(path, x: jax.Array) -> bool:
  """Matrices other than the embeddings (the norms' vectors are not worth a copy; the embeddings are gathered, and
  a gather from a copy made float32 again converts the whole table back)."""
  return x.ndim >= 2 and x.dtype == jnp.float32 and "embed" not in (getattr(k, "key", None) for k in path)


def computed_from(params, low):
  """`params` for the model, each copied matrix's values those of its copy in `low` (None: `params` as they are)."""
  if low is None:
    return params
  return jax.tree_util.tree_map_with_path(lambda path, p, q: computed_as(p, q) if _copied(path, p) else p, params, low)


class LowCopy:
  """The copy in `dtype` of the latest weights it was asked for (`of`): made when they change, dropped on `clear`.
  Off (`of` gives None) without a `dtype` or unless a CPU computes in `dtype` at low precision."""

  def __init__(self, dtype=None, jit=jax.jit):
    self.on = dtype is not None and cpu_low_precision(jnp.dtype(dtype))
    self._cast = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, p: p.astype(dtype) if _copied(path, p) else p, params)
    self._convert = jit(self._cast)
    self._source, self._copy = None, None

  def of(self, params):
    if not self.on:
      return None
    if shapes_only(params):  # a plan's shapes: the copy's shapes, placed as the weights are
      return jax.tree.map(lambda c, p: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=p.sharding),
                          jax.eval_shape(self._cast, params), params)
    if self._source is not params:
      self._source, self._copy = params, self._convert(params)
    return self._copy

  def clear(self) -> None:
    """Forgets the copy (before an update donates the weights it was made from)."""
    self._source = self._copy = None
