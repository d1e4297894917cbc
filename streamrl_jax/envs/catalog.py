"""Environments by name: the built-in ones registered, the one a config names made."""

from __future__ import annotations

from streamrl_jax.envs import calculator_env  # noqa: F401 - registers "calculator"
from streamrl_jax.envs.base import ENVIRONMENTS, Environment


def make_environment(name: str, **kwargs) -> Environment:
  """The environment registered as `name` (`ENVIRONMENTS.names()` lists them)."""
  return ENVIRONMENTS.get(name)(**kwargs)
