"""Environments of multi-turn rollouts (tools the model calls mid-sample) and their host-side runner."""

from streamrl_jax.envs.base import ENVIRONMENTS, Environment, Observation
from streamrl_jax.envs.catalog import make_environment
from streamrl_jax.envs.config import EnvConfig
from streamrl_jax.envs.calculator import CalculatorError, evaluate
from streamrl_jax.envs.calculator_env import CalculatorEnv, parse_call
from streamrl_jax.envs.tools import ToolResult, ToolRunner, make_tools

__all__ = ["ENVIRONMENTS", "CalculatorEnv", "CalculatorError", "EnvConfig", "Environment", "Observation", "ToolResult",
           "ToolRunner", "evaluate", "make_environment", "make_tools", "parse_call"]
