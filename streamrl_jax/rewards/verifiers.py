"""Built-in verifiers, each a plain reward function usable by path (`streamrl_jax.rewards.verifiers:NAME`):
`fn(prompt, completion, **fields) -> float`, reading the reference from the row's `answer` column."""

from __future__ import annotations

import re
import threading
import unicodedata

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
BOXED_FORMAT = r"(?s).*\\boxed\{.+\}\s*"  # the regex_format default: the completion ends in a \boxed{...} answer


def extract_number(text: str) -> float | None:
  """The number after `####` (GSM8K's answers), else the last number in the text (commas between digits dropped)."""
  found = _NUMBER.findall(text.split("####")[-1])
  return float(found[-1].replace(",", "")) if found else None


def numeric_answer(prompt: str, completion: str, answer, tolerance: float = 1e-6, **fields) -> float:
  """1.0 when the completion's final number equals the reference's, else 0.0: two integers exactly (999,999 is not
  1,000,000), otherwise within a relative `tolerance`."""
  expected = extract_number(str(answer))
  if expected is None:
    raise ValueError(f"the reference answer {str(answer)[:60]!r} holds no number")
  got = extract_number(completion)
  if got is None:
    return 0.0
  if float(got).is_integer() and float(expected).is_integer():
    return float(got == expected)
  return float(abs(got - expected) <= tolerance * max(1.0, abs(expected)))


def normalize_text(text: str) -> str:
  """Unicode NFKC, case folded, white space collapsed, trailing punctuation and outer quotes dropped."""
  text = " ".join(unicodedata.normalize("NFKC", str(text)).casefold().split())
  return text.strip().rstrip(".!?;:,").strip().strip("\"'`").strip()


def exact_match(prompt: str, completion: str, answer, **fields) -> float:
  """1.0 when the completion, normalized (`normalize_text`), equals the normalized answer (or, with a list of
  answers, any of them)."""
  answers = answer if isinstance(answer, (list, tuple)) else [answer]
  got = normalize_text(completion)
  return float(any(got == normalize_text(a) for a in answers))


def make_regex_reward(pattern: str, name: str = "regex_format"):
  """A reward function giving 1.0 when the whole completion matches `pattern` (re.fullmatch), else 0.0. Bind
  one in your module (`my_format = make_regex_reward(r'...')`) and name it by path."""
  compiled = re.compile(pattern)

  def reward(prompt: str, completion: str, **fields) -> float:
    return float(compiled.fullmatch(completion) is not None)

  reward.__name__ = reward.__qualname__ = name
  reward.__doc__ = f"1.0 when the whole completion matches {pattern!r}."
  return reward


def regex_format(prompt: str, completion: str, format_regex: str = BOXED_FORMAT, **fields) -> float:
  """1.0 when the whole completion matches the row's `format_regex` column (default: ends in `\\boxed{...}`)."""
  return float(re.fullmatch(format_regex, completion) is not None)


def math_equivalence(prompt: str, completion: str, answer, **fields) -> float:
  """1.0 when the completion's final answer is mathematically equal to the reference (`math-verify`: a
  `\\boxed{}` answer, LaTeX, fractions, decimals, sets and intervals), else 0.0."""
  try:
    from math_verify import parse, verify
  except ImportError as err:
    raise ImportError("math_equivalence needs the math-verify package: pip install math-verify") from err
  # math-verify bounds its own work with SIGALRM, which only the main thread may set
  timeout = 5 if threading.current_thread() is threading.main_thread() else None
  reference = str(answer)
  gold = parse(reference if "$" in reference or "\\" in reference else f"${reference}$", parsing_timeout=timeout)
  if not gold:
    raise ValueError(f"math-verify finds no answer in the reference {reference[:60]!r}")
  predicted = parse(completion, parsing_timeout=timeout)
  return float(bool(predicted) and verify(gold, predicted, timeout_seconds=timeout))
