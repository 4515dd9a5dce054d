"""A small LaTeX expression parser and evaluator (pure Python) for math answer equivalence.

:func:`parse` turns numeric LaTeX (fractions, ``\\sqrt``, ``\\pi``, powers, implicit products,
``\\sin``/``\\ln``/...) into a small tree of tuples; :func:`evaluate` folds the tree into a float
(the ``python`` backend of :func:`jaxrl.rewards.is_equivalent`), an exact fraction (the calculator
tool of :mod:`jaxrl.envs`) or a sympy expression (the ``sympy`` backend).
"""

from __future__ import annotations

import functools
import math
import operator
import re
from fractions import Fraction
from typing import Any, Literal


class ParseError(ValueError):
  """The text is not an expression the grammar reads, or its tree has no value in the asked domain."""


_TOKEN = re.compile(
  r"\s*(?:(?P<num>\d+(?:\.\d*)?|\.\d+)|(?P<cmd>\\[A-Za-z]+)|(?P<sym>[A-Za-z])|(?P<op>\*\*|[-+*/^(){}\[\],|]))"
)
_MUL_CMDS = {"\\cdot": "*", "\\times": "*", "\\div": "/"}
_CONSTS = {"\\pi": ("const", "pi"), "\\infty": ("const", "oo")}
_FUNCS = {"\\sin", "\\cos", "\\tan", "\\ln", "\\log", "\\exp"}


def _tokenize(s: str) -> list[tuple[str, str]]:
  out, i = [], 0
  s = s.strip()
  while i < len(s):
    m = _TOKEN.match(s, i)
    if not m or m.end() == i:
      raise ParseError(f"unexpected {s[i:i + 10]!r}")
    kind = m.lastgroup
    value = m.group(kind)
    if kind == "cmd" and value in _MUL_CMDS:
      kind, value = "op", _MUL_CMDS[value]
    out.append((kind, value))
    i = m.end()
    while i < len(s) and s[i].isspace():
      i += 1
  return out


class _Parser:
  """Recursive descent over the tokens into a tiny AST of tuples.

  Nodes: ``("num", str)``, ``("sym", name)``, ``("const", "pi"|"oo")``, ``("neg", a)``,
  ``("add"|"sub"|"mul"|"div"|"pow", a, b)``, ``("sqrt", a)``, ``("root", n, a)``,
  ``("fn", name, a)``.
  """

  def __init__(self, tokens: list[tuple[str, str]]):
    self.t, self.i = tokens, 0

  def peek(self) -> tuple[str, str] | None:
    return self.t[self.i] if self.i < len(self.t) else None

  def take(self, value: str | None = None) -> tuple[str, str]:
    tok = self.peek()
    if tok is None or (value is not None and tok[1] != value):
      raise ParseError(f"expected {value!r}, got {tok}")
    self.i += 1
    return tok

  def parse(self):
    node = self.expr()
    if self.peek() is not None:
      raise ParseError(f"trailing {self.peek()}")
    return node

  def expr(self):
    node = self.term()
    while (tok := self.peek()) and tok[1] in ("+", "-"):
      self.take()
      node = ("add" if tok[1] == "+" else "sub", node, self.term())
    return node

  def _starts_atom(self, tok) -> bool:
    kind, value = tok
    return kind in ("num", "sym") or value in ("(", "{") or (kind == "cmd" and (
      value in ("\\frac", "\\sqrt") or value in _CONSTS or value in _FUNCS))

  def term(self):
    node = self.unary()
    while (tok := self.peek()):
      if tok[1] in ("*", "/"):
        self.take()
        node = ("mul" if tok[1] == "*" else "div", node, self.unary())
      elif self._starts_atom(tok):
        node = ("mul", node, self.power())
      else:
        break
    return node

  def unary(self):
    tok = self.peek()
    if tok and tok[1] in ("+", "-"):
      self.take()
      inner = self.unary()
      return inner if tok[1] == "+" else ("neg", inner)
    return self.power()

  def power(self):
    base = self.atom()
    tok = self.peek()
    if tok and tok[1] in ("^", "**"):
      self.take()
      nxt = self.peek()
      exp = self.group() if nxt and nxt[1] == "{" else self.unary_atom()
      return ("pow", base, exp)
    return base

  def unary_atom(self):
    tok = self.peek()
    if tok and tok[1] == "-":
      self.take()
      return ("neg", self.atom())
    return self.atom()

  def group(self):
    """``{expr}`` or a single atom (``\\frac12`` is already normalised to braces)."""
    tok = self.peek()
    if tok and tok[1] == "{":
      self.take("{")
      node = self.expr()
      self.take("}")
      return node
    return self.atom()

  def atom(self):
    tok = self.peek()
    if tok is None:
      raise ParseError("unexpected end")
    kind, value = tok
    if kind == "num":
      self.take()
      return ("num", value)
    if kind == "sym":
      self.take()
      return ("sym", value)
    if value in ("(", "{"):
      self.take()
      node = self.expr()
      self.take(")" if value == "(" else "}")
      return node
    if value == "\\frac":
      self.take()
      return ("div", self.group(), self.group())
    if value == "\\sqrt":
      self.take()
      if (nxt := self.peek()) and nxt[1] == "[":
        self.take("[")
        n = self.expr()
        self.take("]")
        return ("root", n, self.group())
      return ("sqrt", self.group())
    if value in _CONSTS:
      self.take()
      return _CONSTS[value]
    if value in _FUNCS:
      self.take()
      return ("fn", value[1:], self.power())
    raise ParseError(f"unsupported token {value!r}")


@functools.lru_cache(maxsize=4096)
def parse(s: str):
  """The expression tree of the numeric LaTeX ``s`` (node kinds in :class:`_Parser`).

  Raises :class:`ParseError` when ``s`` is not an expression the grammar reads.
  """
  return _Parser(_tokenize(s)).parse()


Domain = Literal["float", "exact", "sympy"]

_FN_NAMES = {"ln": "log"}  # parser function name -> math / sympy name (log is natural in both)


def _divide(a, b):
  if b == 0:
    raise ZeroDivisionError("division by zero")
  return a / b


def _float_const(name: str) -> float:
  if name == "pi":
    return math.pi
  raise ParseError("infinity")


def _float_symbol(name: str) -> float:
  raise ParseError("symbolic")


def _float_pow(a: float, b: float) -> float:
  if abs(b) > 1000 or (abs(a) > 1 and abs(b) * math.log10(abs(a)) > 300):
    raise ParseError("power too large")
  out = a ** b
  if isinstance(out, complex):
    raise ParseError("complex")
  return out


def _exact_pow(a: Fraction, b: Fraction) -> Fraction:
  if b.denominator != 1 or abs(b) > 4096 or (abs(a) > 1 and abs(b) * math.log10(abs(a)) > 4096):
    raise ParseError("power must have an integer exponent and a result below 10**4096")
  if a == 0 and b < 0:
    raise ZeroDivisionError("division by zero")
  return a ** int(b)


# What each domain does with the node kinds beyond + - * and negation; a kind a domain lacks raises
# ParseError with the domain's "why".
_FLOAT = {
    "num": float, "sym": _float_symbol, "const": _float_const,
    "fn": lambda name, x: getattr(math, _FN_NAMES.get(name, name))(x),
    "sqrt": math.sqrt, "root": lambda n, x: x ** (1.0 / n), "div": _divide, "pow": _float_pow,
    "why": "not a real-number expression",
}
_EXACT = {
    "num": Fraction, "div": _divide, "pow": _exact_pow,
    "why": "the calculator takes numbers, + - * / ^ and parentheses",
}


@functools.lru_cache(maxsize=None)
def _sympy_domain() -> dict[str, Any]:
  import sympy  # lazy: sympy is a heavy optional dependency, needed only by the sympy backend

  return {
      "num": sympy.Rational, "sym": sympy.Symbol,
      "const": lambda name: sympy.pi if name == "pi" else sympy.oo,
      "fn": lambda name, x: getattr(sympy, _FN_NAMES.get(name, name))(x),
      "sqrt": sympy.sqrt, "root": lambda n, x: x ** (1 / n), "div": operator.truediv,
      "pow": operator.pow, "why": "not an expression node",
  }


_RING = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


def _fold(node, ops: dict[str, Any]):
  kind = node[0]
  if kind == "neg":
    return -_fold(node[1], ops)
  if kind in _RING:
    return _RING[kind](_fold(node[1], ops), _fold(node[2], ops))
  op = ops.get(kind)
  if op is None:
    raise ParseError(f"unsupported {kind!r} ({ops['why']})")
  if kind in ("num", "sym", "const"):
    return op(node[1])
  if kind == "fn":
    return op(node[1], _fold(node[2], ops))
  if kind == "sqrt":
    return op(_fold(node[1], ops))
  return op(_fold(node[1], ops), _fold(node[2], ops))  # root (n, x), div, pow


def evaluate(node, *, domain: Domain = "float") -> Any:
  """The value of a :func:`parse` tree in one number domain (the only walker over these trees).

  Domains:
    ``"float"``: a Python float through :mod:`math` (``\\pi``, functions, roots). Symbols and
      ``\\infty`` raise :class:`ParseError`, and so do complex powers and powers past ~1e300
      (or with an exponent over 1000); division by zero raises ``ZeroDivisionError``.
    ``"exact"``: a :class:`fractions.Fraction`, for numbers, ``+ - * /`` and integer powers with a
      result below ``10**4096``; any other node raises :class:`ParseError`, division by zero
      ``ZeroDivisionError``.
    ``"sympy"``: a sympy expression (symbols, ``pi`` and ``oo`` kept symbolic; needs sympy).

  Example:
    >>> evaluate(parse("1/3 + 2^{-1}"), domain="exact")
    Fraction(5, 6)
  """
  if domain == "float":
    return _fold(node, _FLOAT)
  if domain == "exact":
    return _fold(node, _EXACT)
  if domain == "sympy":
    return _fold(node, _sympy_domain())
  raise ValueError(f"unknown domain {domain!r}; choose one of {Domain.__args__}")
