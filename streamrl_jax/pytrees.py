"""Pytrees as flat {key path: leaf} dicts and back: the naming that checkpoints and weight transfer share."""

from __future__ import annotations

import jax


def flatten_with_names(tree) -> dict:
  """{"['layers'][0]['mlp']...": leaf} for every leaf of `tree`."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def unflatten_like(template, flat: dict, what: str = "checkpoint"):
  """`template`'s structure with the leaves of `flat` (by name); raises KeyError naming missing leaves."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  names = [jax.tree_util.keystr(p) for p, _ in paths]
  missing = [n for n in names if n not in flat]
  if missing:
    raise KeyError(f"{what} lacks {len(missing)} arrays of the template (first: {missing[:3]})")
  return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])
