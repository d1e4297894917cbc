"""Rewards: functions named in the config, built-in verifiers, and the scorer that runs them off the decode loop.

Importing this package does not import JAX: scoring workers start fast.
"""

from streamrl_jax.rewards.config import BUILTIN, ON_ERROR, RewardConfig
from streamrl_jax.rewards.functions import RewardFunctionError, check_signature, checked_value, load_function
from streamrl_jax.rewards.scorer import RewardError, RewardScorer, Score
from streamrl_jax.rewards.verifiers import (exact_match, extract_number, make_regex_reward, math_equivalence,
                                            normalize_text, numeric_answer, regex_format)

__all__ = ["BUILTIN", "ON_ERROR", "RewardConfig", "RewardError", "RewardFunctionError", "RewardScorer", "Score",
           "check_signature", "checked_value", "exact_match", "extract_number", "load_function", "make_regex_reward",
           "math_equivalence", "normalize_text", "numeric_answer", "regex_format"]
