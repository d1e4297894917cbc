"""A calculator for tool calls: arithmetic parsed with the standard library's `ast` and evaluated by a walk
over a whitelist of nodes. Model output is never passed to `eval` or `exec`.

Grammar: integers, `+ - * / // % **`, unary `+ -`, parentheses. Bounded: at most `MAX_CHARS` characters,
`MAX_DEPTH` levels of nesting, exponents up to `MAX_EXPONENT`, and no value beyond `MAX_DIGITS` digits.
Anything else (names, calls, attributes, strings, floats) raises `CalculatorError` naming what was refused.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

MAX_CHARS, MAX_DEPTH, MAX_EXPONENT, MAX_DIGITS = 200, 24, 64, 60


class CalculatorError(ValueError):
  """An expression the calculator refuses or cannot evaluate."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}


def _nesting(text: str) -> int:
  depth = deepest = 0
  for char in text:
    depth += char == "("
    depth -= char == ")"
    deepest = max(deepest, depth)
  return deepest


def _check_size(value: Fraction) -> Fraction:
  for part in (value.numerator, value.denominator):
    if part != 0 and math.log10(abs(part)) >= MAX_DIGITS:
      raise CalculatorError(f"a value beyond {MAX_DIGITS} digits")
  return value


def _walk(node: ast.AST, depth: int) -> Fraction:
  if depth > MAX_DEPTH:
    raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
  if isinstance(node, ast.Constant) and type(node.value) is int:
    return _check_size(Fraction(node.value))
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_walk(node.operand, depth + 1))
  if isinstance(node, ast.BinOp) and type(node.op) is ast.Pow:
    base, exponent = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
    if exponent.denominator != 1 or not 0 <= exponent <= MAX_EXPONENT:
      raise CalculatorError(f"exponent {exponent} (integers 0 to {MAX_EXPONENT})")
    if base != 0 and max(math.log10(abs(base.numerator)), math.log10(base.denominator)) * int(exponent) >= MAX_DIGITS:
      raise CalculatorError(f"a value beyond {MAX_DIGITS} digits")
    return _check_size(base ** int(exponent))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
    if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
      raise CalculatorError("division by zero")
    return _check_size(Fraction(_BINARY[type(node.op)](left, right)))
  raise CalculatorError(f"{type(node).__name__} is not allowed")


def evaluate(text: str) -> Fraction:
  """The value of an arithmetic expression; `CalculatorError` for anything outside the grammar or bounds."""
  if len(text) > MAX_CHARS:
    raise CalculatorError(f"an expression of {len(text)} characters (at most {MAX_CHARS})")
  if _nesting(text) > MAX_DEPTH:
    raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
  try:
    tree = ast.parse(text.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
    raise CalculatorError(f"not an expression: {type(err).__name__}") from None
  return _walk(tree.body, 0)


def format_value(value: Fraction) -> str:
  """An integer as its digits; otherwise a decimal to 6 places."""
  if value.denominator == 1:
    return str(value.numerator)
  scaled = round(value * 10**6)  # exact: no float on the way
  sign, digits = ("-" if scaled < 0 else ""), str(abs(scaled)).rjust(7, "0")
  return f"{sign}{digits[:-6]}.{digits[-6:]}".rstrip("0").rstrip(".")
