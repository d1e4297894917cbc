"""A task's questions put into a model's chat template; rewards see the question as the task wrote it."""

from __future__ import annotations

import dataclasses

from streamrl_jax.models.chat import ChatFormat
from streamrl_jax.tasks.rows import Row, draw, verifier


@dataclasses.dataclass(frozen=True)
class ChatTask:
  task: object  # anything with sample(rng) -> (prompt, answer) and reward(prompt, completion, **fields)
  chat: ChatFormat

  def sample(self, rng) -> tuple[str, str]:
    question, answer = self.task.sample(rng)
    return self.chat.wrap(question), answer

  def draw(self, rng) -> tuple[str, Row]:
    question, row = draw(self.task, rng)
    return self.chat.wrap(question), row

  @property
  def inner_task(self):
    """The task that scores a question (rewards see the question, never the template around it)."""
    return self.task

  def encode(self, tokenizer, prompt: str) -> list[int]:
    """A rendered prompt holds its special tokens already: none are added (transformers' apply_chat_template)."""
    return tokenizer.encode(prompt)

  def question(self, prompt: str) -> str:
    return self.chat.unwrap(prompt)

  def reward(self, prompt: str, completion: str, **fields) -> float:
    return verifier(self.task)(self.chat.unwrap(prompt), completion, fields)
