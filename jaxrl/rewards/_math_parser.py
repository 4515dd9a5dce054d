"""A small LaTeX expression parser and evaluator (pure Python) for math answer equivalence.

:func:`_parse` turns numeric LaTeX (fractions, ``\\sqrt``, ``\\pi``, powers, implicit products,
``\\sin``/``\\ln``/...) into a small tree of tuples; :func:`_evaluate` computes its value and
:mod:`jaxrl.rewards._math` hands the same tree to sympy. Used by the ``python`` and ``sympy``
backends of :func:`jaxrl.rewards.is_equivalent`.
"""

from __future__ import annotations

import functools
import math
import re

class _ParseError(ValueError):
  pass


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
      raise _ParseError(f"unexpected {s[i:i + 10]!r}")
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
      raise _ParseError(f"expected {value!r}, got {tok}")
    self.i += 1
    return tok

  def parse(self):
    node = self.expr()
    if self.peek() is not None:
      raise _ParseError(f"trailing {self.peek()}")
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
      raise _ParseError("unexpected end")
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
    raise _ParseError(f"unsupported token {value!r}")


@functools.lru_cache(maxsize=4096)
def _parse(s: str):
  return _Parser(_tokenize(s)).parse()


def _evaluate(node) -> float:
  kind = node[0]
  if kind == "num":
    return float(node[1])
  if kind == "const":
    if node[1] == "pi":
      return math.pi
    raise _ParseError("infinity")
  if kind == "sym":
    raise _ParseError("symbolic")
  if kind == "neg":
    return -_evaluate(node[1])
  if kind == "fn":
    return getattr(math, {"ln": "log"}.get(node[1], node[1]))(_evaluate(node[2]))
  if kind == "sqrt":
    return math.sqrt(_evaluate(node[1]))
  a = _evaluate(node[1])
  if kind == "root":
    return _evaluate(node[2]) ** (1.0 / a)
  b = _evaluate(node[2])
  if kind == "add":
    return a + b
  if kind == "sub":
    return a - b
  if kind == "mul":
    return a * b
  if kind == "div":
    return a / b
  if kind == "pow":
    if abs(b) > 1000 or (abs(a) > 1 and abs(b) * math.log10(abs(a)) > 300):
      raise _ParseError("power too large")
    out = a ** b
    if isinstance(out, complex):
      raise _ParseError("complex")
    return out
  raise _ParseError(kind)
