"""An agent program trained by `streamrl train`: a tool-calling loop written against the `openai` client alone.

The policy solves `A*B=` and may call a calculator by writing `<EXPR>`. This program asks the sampler's server for a
completion that stops at `>`; when the text ends in a call, it works the expression out itself and sends the
conversation back with the result appended, and the policy goes on. Its final text (`...;=ANSWER`) is what it
returns: the task's reward function scores it. The sampler records every turn's sampled tokens; the tokens this
program adds (the results) are masked out of training.

Train it: `streamrl train --config examples/agent/agent.gin --workdir runs/agent`
"""

from __future__ import annotations

import ast
import operator
import re

import openai

MODEL = "policy"  # the name the sampler's server answers to
MAX_CALLS = 2
CALL = re.compile(r"<([0-9+\-*/() ]{1,40})$")  # a call at the end of the policy's text
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
  """The value of `expression` (integers, + - * and parentheses), or `error`."""
  def value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
      return OPERATORS[type(node.op)](value(node.left), value(node.right))
    raise ValueError(expression)
  try:
    result = value(ast.parse(expression, mode="eval").body)
  except (SyntaxError, ValueError, RecursionError):
    return "error"
  return str(result) if abs(result) < 10**12 else "error"


async def run(client: openai.AsyncOpenAI, prompt_row: dict) -> str:
  """One episode: the policy's text after the prompt, calculator results included."""
  prompt, text = prompt_row["prompt"], ""
  for _ in range(MAX_CALLS + 1):
    try:
      reply = await client.completions.create(model=MODEL, prompt=prompt + text, max_tokens=32, temperature=1.0,
                                              stop=[">"])
    except openai.BadRequestError:  # the episode's token budget is spent: what it wrote is its answer
      break
    choice = reply.choices[0]
    text += choice.text
    call = CALL.search(choice.text)
    if choice.finish_reason != "stop" or call is None:
      break  # it answered (or ran out of room)
    text += ">" + calculate(call.group(1))
  return text
