"""Prompt sources with verifiable rewards; every reward is a pure function of text."""

from streamrl_jax.tasks.arithmetic import (ArithmeticTask, arithmetic_reward, digit_count_probabilities,
                                           worked_solution)
from streamrl_jax.tasks.chat import ChatTask
from streamrl_jax.tasks.countdown import CountdownTask, countdown_reward
from streamrl_jax.tasks.multiply import MultiplyTask, multiply_reward
from streamrl_jax.tasks.files import FileTask, PromptFile, numeric_answer_reward, prompt_iterator
from streamrl_jax.tasks.rows import Row, draw, prompt_tokens, question, verifier
from streamrl_jax.tasks.sums import SumsTask, format_ok, sums_reward

__all__ = ["MultiplyTask", "multiply_reward", "ArithmeticTask", "ChatTask", "CountdownTask", "FileTask", "PromptFile", "arithmetic_reward", "countdown_reward",
           "digit_count_probabilities", "numeric_answer_reward", "prompt_iterator", "Row", "draw", "prompt_tokens", "question", "verifier", "SumsTask", "format_ok",
           "sums_reward", "worked_solution"]
