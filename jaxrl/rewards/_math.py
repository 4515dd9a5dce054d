"""Math answer extraction, equivalence checking and the binary math reward.

The reward follows DeepScaleR's outcome reward (seed 000, "Reward Function"): the correct value
when the final answer checks out and the completion has its ``<think>…</think>`` delimiters,
otherwise the incorrect (or format-error) value. AReaL's ±5 is `MathRewardConfig.areal`.

Equivalence has three backends, each a superset of the one before:

* ``python`` (always available): string equality after MATH-style normalisation
  (`normalize_answer`), then a pure-Python parser (`jaxrl.rewards._math_parser`) that evaluates
  numeric LaTeX (fractions, ``\\sqrt``, ``\\pi``, powers, implicit products) and compares tuples and
  intervals element-wise with their brackets; numbers are equal within a relative 1e-9.
* ``sympy``: adds symbolic equality of expressions with variables (``(x+1)^2`` vs ``x^2+2x+1``)
  via ``sympy.simplify`` on the parser's output.
* ``math_verify``: adds Hugging Face's ``math-verify`` (``parse`` + ``verify``), which also reads
  sets, equations, percentages as fractions (``50\\%`` = ``0.5``) and rounds to the precision of
  the shorter decimal (``\\sqrt2`` = ``1.41421356``).

``auto`` picks the strongest installed. math-verify's own timeouts use ``SIGALRM`` and so only work
in the main thread; elsewhere they are off and `MathRewardConfig.max_answer_chars` bounds the work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
from collections.abc import Sequence
from typing import Any, Literal

from jaxrl.rewards._base import RewardResult, as_config
from jaxrl.rewards._format import FormatConfig, check_format
from jaxrl.rewards._math_parser import ParseError, evaluate, parse

__all__ = [
  "MathRewardConfig",
  "extract_answer",
  "extract_boxed",
  "is_equivalent",
  "math_backends",
  "math_reward",
  "normalize_answer",
]

Backend = Literal["auto", "python", "sympy", "math_verify"]

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> tuple[str, int] | None:
  """The content of the ``{…}`` group opening at ``text[start]`` and the index after it."""
  depth, i = 0, start
  while i < len(text):
    c = text[i]
    if c == "\\":
      i += 2  # an escaped brace \{ \} does not nest
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[start + 1:i], i + 1
    i += 1
  return None


def extract_boxed(text: str) -> str | None:
  """The content of the last ``\\boxed{…}`` or ``\\fbox{…}`` in `text` (nested braces kept).

  Also reads the brace-less ``\\boxed 5``. Returns None when there is none (or it is unclosed).

  Example:
    >>> extract_boxed(r"so \\boxed{\\frac{1}{\\sqrt{2}}}.")
    '\\\\frac{1}{\\\\sqrt{2}}'
  """
  for m in reversed(list(_BOXED.finditer(text))):
    i = m.end()
    while i < len(text) and text[i] == " ":
      i += 1
    if i < len(text) and text[i] == "{":
      got = _braced(text, i)
      if got is not None:
        return got[0].strip()
    elif i > m.end():  # "\boxed 5": up to the next space or $
      token = re.match(r"[^\s$]+", text[i:])
      if token:
        return token.group(0)
  return None


_ANSWER_LINE = re.compile(r"\b(?:final\s+answer|answer)\b(?:\s+is\b|\s*[:=])\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _clean_answer_line(s: str) -> str:
  s = s.strip().strip("*").strip()
  if s.startswith("$") and s.count("$") >= 2:
    s = s[1:s.index("$", 1)]
  s = s.strip().rstrip(".").strip()
  return s


def extract_answer(
  text: str, *, methods: Sequence[str] = ("boxed", "answer_line", "last_number")
) -> tuple[str, str] | None:
  """The final answer of `text` and the method that found it, trying `methods` in order.

  Methods: ``boxed`` (`extract_boxed`), ``answer_line`` (the rest of the last line saying
  "Answer: …" / "the answer is …", with ``$…$`` and a final period removed) and ``last_number``
  (the last integer, decimal or ``a/b`` in the text).

  Example:
    >>> extract_answer("... so the answer is $\\\\frac{3}{4}$.")
    ('\\\\frac{3}{4}', 'answer_line')
  """
  for method in methods:
    if method == "boxed":
      got = extract_boxed(text)
    elif method == "answer_line":
      matches = [m for line in text.splitlines() for m in [_ANSWER_LINE.search(line)] if m]
      got = _clean_answer_line(matches[-1].group(1)) if matches else None
      got = got or None
    elif method == "last_number":
      nums = _NUMBER.findall(text)
      got = nums[-1] if nums else None
    else:
      raise ValueError(f"methods: unknown extraction method {method!r} (boxed/answer_line/last_number)")
    if got is not None:
      return got, method
  return None


# ---------------------------------------------------------------------------------------------
# Normalisation (pure Python)
# ---------------------------------------------------------------------------------------------

_TEXT_CMDS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{")
_UNITS = (
  "square units|sq units|units|unit|cm|mm|km|m|meters|metres|meter|inches|inch|in|feet|foot|ft|"
  "yards|yard|yd|miles|mile|mi|degrees|degree|deg|dollars|dollar|cents|cent|seconds|second|sec|s|"
  "minutes|minute|min|hours|hour|hrs|hr|h|days|day|kg|g|grams|gram|lbs|lb|pounds|pound|liters|"
  "litres|liter|l|ml|mph|km/h|m/s"
)
_UNIT_SUFFIX = re.compile(rf"^(.*?[\d}}).])\s*(?:{_UNITS})(?:\^\{{?[23]\}}?|²|³)?$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _unwrap_text(s: str) -> str:
  while True:
    m = _TEXT_CMDS.search(s)
    if not m:
      return s
    got = _braced(s, m.end() - 1)
    if got is None:
      return s
    s = s[:m.start()] + got[0] + s[got[1]:]


def _fix_fracs(s: str) -> str:
  """``\\frac12`` → ``\\frac{1}{2}``, ``\\frac1{x}`` → ``\\frac{1}{x}``; same for ``\\sqrt2``."""
  s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
  s = re.sub(r"\\frac\s*(\d)\s*(?=\{)", r"\\frac{\1}", s)
  s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
  s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", s)
  return s


def normalize_answer(s: str) -> str:
  """A canonical string for a final answer (the MATH benchmark's ``strip_string``, extended).

  Unwraps ``\\text{…}``, drops ``$``, ``\\left``/``\\right``, spacing commands, degree signs, a
  ``%``, a trailing period, a known unit word after a number (``5 cm``), a short ``x =`` prefix
  and thousands separators in a plain number; rewrites ``\\dfrac``/``\\tfrac`` as ``\\frac``,
  ``\\frac12`` as ``\\frac{1}{2}``, ``a/b`` of integers as ``\\frac{a}{b}``, ``.5`` as ``0.5``
  and ``(B)`` as ``B``; removes spaces.

  Example:
    >>> normalize_answer(r"x = \\dfrac12 \\text{ cm}.")
    '\\\\frac{1}{2}'
  """
  s = str(s).strip()
  s = _unwrap_text(s)
  s = s.replace("\n", " ").replace("\\$", "").replace("$", "")
  s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
  s = re.sub(r"\\(?:displaystyle|quad|qquad)(?![A-Za-z])", " ", s)
  s = re.sub(r"\\[!,;: ]", " ", s).replace("~", " ")
  s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
  s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree", "", s)
  s = s.replace("\\%", "").replace("%", "")
  s = s.replace("{,}", ",")
  s = s.strip().rstrip(".").strip()
  m = _UNIT_SUFFIX.match(s)
  if m:
    s = m.group(1).strip()
  parts = s.split("=")
  if len(parts) == 2 and re.fullmatch(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*", parts[0]):
    s = parts[1].strip()
  if _THOUSANDS.match(s.replace(" ", "")):
    s = s.replace(",", "")
  s = _fix_fracs(s)
  s = s.replace(" ", "")
  if re.fullmatch(r"-?\d+/\d+", s):
    num, den = s.split("/")
    s = f"\\frac{{{num}}}{{{den}}}" if not num.startswith("-") else f"-\\frac{{{num[1:]}}}{{{den}}}"
  s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)
  m = re.fullmatch(r"\(([A-Za-z])\)", s)
  if m:
    s = m.group(1)
  return s


def _numeric(s: str) -> float | None:
  try:
    value = evaluate(parse(s))
  except (ParseError, ArithmeticError, ValueError, RecursionError):
    return None
  return value if math.isfinite(value) else None


def _split_top(s: str) -> list[str]:
  parts, depth, cur = [], 0, []
  for c in s:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  parts.append("".join(cur))
  return parts


def _sequence(s: str) -> tuple[str, str, list[str]] | None:
  """``(open, close, items)`` for a tuple/interval ``(1,2]``, a set ``\\{1,2\\}`` or a bare list."""
  if s.startswith("\\{") and s.endswith("\\}"):
    return "{", "}", _split_top(s[2:-2])
  if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
    inner = s[1:-1]
    depth = 0
    for c in inner:  # "(1)+(2)" is not a tuple: the outer pair must match itself
      depth += c in "([{"
      depth -= c in ")]}"
      if depth < 0:
        return None
    items = _split_top(inner)
    if len(items) >= 2:
      return s[0], s[-1], items
    return None
  items = _split_top(s)
  return ("", "", items) if len(items) >= 2 else None


def _python_equal(a: str, b: str) -> bool:
  if a == b:
    return True
  sa, sb = _sequence(a), _sequence(b)
  if sa or sb:
    if not (sa and sb) or sa[:2] != sb[:2] or len(sa[2]) != len(sb[2]):
      return False
    if sa[0] == "{":  # sets: order-free
      rest = list(sb[2])
      for x in sa[2]:
        hit = next((k for k, y in enumerate(rest) if _python_equal(x, y)), None)
        if hit is None:
          return False
        rest.pop(hit)
      return True
    return all(_python_equal(x, y) for x, y in zip(sa[2], sb[2]))
  va, vb = _numeric(a), _numeric(b)
  return va is not None and vb is not None and math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# Optional backends
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def math_backends() -> dict[str, str | None]:
  """The installed version of each optional backend (None when missing)."""
  from importlib import metadata

  out: dict[str, str | None] = {"python": "builtin"}
  for name, dist in (("sympy", "sympy"), ("math_verify", "math-verify")):
    try:
      __import__(name)
      out[name] = metadata.version(dist)
    except Exception:  # noqa: BLE001 (absent or broken install: the backend is unavailable)
      out[name] = None
  return out


def _sympy_equal(a: str, b: str) -> bool:
  import sympy

  try:
    ea, eb = evaluate(parse(a), domain="sympy"), evaluate(parse(b), domain="sympy")
    diff = sympy.expand(ea - eb)
    if diff == 0:
      return True
    return bool(sympy.simplify(diff) == 0) if len(a) + len(b) < 200 else False
  except Exception:  # noqa: BLE001 (unparseable or sympy failure: not provably equal)
    return False


def _latex(s: str) -> str:
  return s if re.search(r"(?<!\\)\$", s) or "\\boxed" in s else f"${s}$"


def _math_verify_equal(pred: str, gold: str) -> bool:
  from math_verify import parse, verify

  main = threading.current_thread() is threading.main_thread()
  t = 5 if main else None  # SIGALRM-based timeouts only work in the main thread
  try:
    g = parse(_latex(gold), parsing_timeout=t)
    p = parse(_latex(pred), parsing_timeout=t)
    return bool(verify(g, p, timeout_seconds=t)) if g and p else False
  except Exception:  # noqa: BLE001 (math-verify failures mean "not shown equal")
    return False


def _resolve_backend(backend: Backend) -> str:
  if backend == "auto":
    found = math_backends()
    return "math_verify" if found["math_verify"] else ("sympy" if found["sympy"] else "python")
  if backend not in ("python", "sympy", "math_verify"):
    raise ValueError(f"backend must be auto/python/sympy/math_verify, got {backend!r}")
  if backend != "python" and not math_backends()[backend]:
    pkg = {"sympy": "sympy", "math_verify": "math-verify"}[backend]
    raise ImportError(f"math backend {backend!r} needs the {pkg!r} package (pip install {pkg})")
  return backend


def is_equivalent(pred: str, gold: str, *, backend: Backend = "auto") -> bool:
  """Whether the answer `pred` equals the reference `gold` (see the module docstring).

  Example:
    >>> is_equivalent("0.5", r"\\dfrac12", backend="python")
    True
  """
  name = _resolve_backend(backend)
  a, b = normalize_answer(pred), normalize_answer(gold)
  if not a or not b:
    return False
  if _python_equal(a, b):
    return True
  if name == "sympy":
    return _sympy_equal(a, b)
  if name == "math_verify":
    return _math_verify_equal(pred, gold)
  return False


# ---------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathRewardConfig:
  """Values and checks of `math_reward`. Defaults are DeepScaleR's 1/0 with ``<think>`` required."""

  correct_value: float = 1.0
  """Reward for a correct final answer (with good format)."""
  incorrect_value: float = 0.0
  """Reward for a wrong or missing final answer."""
  format_error_value: float = 0.0
  """Reward when `require_think` is on and the ``<think>…</think>`` format is broken."""
  require_think: bool = True
  """Require the reasoning block (`think` describes it)."""
  think: FormatConfig = dataclasses.field(default_factory=FormatConfig)
  """The format check (tags, single block, prompt-opened think)."""
  answer_after_think: bool = True
  """Look for the answer only after the last close tag when there is one."""
  extract: tuple[str, ...] = ("boxed", "answer_line", "last_number")
  """Extraction methods tried in order (see `extract_answer`)."""
  backend: Backend = "auto"
  """Equivalence backend (see `is_equivalent`)."""
  max_answer_chars: int = 512
  """An extracted answer longer than this is wrong without being parsed (bounds sympy's work)."""

  def __post_init__(self):
    for name in ("correct_value", "incorrect_value", "format_error_value"):
      if not math.isfinite(getattr(self, name)):
        raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")
    bad = [m for m in self.extract if m not in ("boxed", "answer_line", "last_number")]
    if bad or not self.extract:
      raise ValueError(f"extract: unknown or empty methods {list(self.extract)!r}")
    if self.backend not in ("auto", "python", "sympy", "math_verify"):
      raise ValueError(f"backend must be auto/python/sympy/math_verify, got {self.backend!r}")
    if self.max_answer_chars < 1:
      raise ValueError(f"max_answer_chars must be >= 1, got {self.max_answer_chars!r}")

  @classmethod
  def deepscaler(cls, **overrides: Any) -> MathRewardConfig:
    """DeepScaleR: 1 if the ``\\boxed`` answer checks out and ``<think>…</think>`` is present, else 0."""
    return cls(**{"extract": ("boxed",), **overrides})

  @classmethod
  def areal(cls, **overrides: Any) -> MathRewardConfig:
    """AReaL: +5 for a correct answer, -5 otherwise (no format requirement)."""
    return cls(**{"correct_value": 5.0, "incorrect_value": -5.0, "format_error_value": -5.0,
                  "require_think": False, **overrides})


def _gold(answer: Any) -> list[str]:
  answers = list(answer) if isinstance(answer, (list, tuple)) else [answer]
  out = []
  for a in answers:
    a = str(a)
    out.append((extract_boxed(a) or a) if ("\\boxed" in a or "\\fbox" in a) else a)
  return out


def math_reward(
  prompt: str, completion: str, *, answer: Any, config: MathRewardConfig | dict | None = None, **_: Any
) -> RewardResult:
  """DeepScaleR-style binary reward for a math completion.

  Args:
    prompt: the prompt (used only to detect a ``<think>`` opened by the chat template).
    completion: the generated text.
    answer: the reference answer (a string, number, ``\\boxed{…}`` solution, or a list of
      acceptable answers).
    config: values and checks; a dict is read as `MathRewardConfig` fields.

  Returns:
    ``RewardResult`` with ``info["reason"]`` in ``correct``, ``wrong_answer``, ``no_answer``,
    ``answer_too_long`` or ``format:<why>``, plus ``extracted`` and ``method``.

  Example:
    >>> math_reward("Q", "<think>half</think> The answer is \\\\boxed{\\\\dfrac12}.", answer="0.5").value
    1.0
  """
  cfg = as_config(MathRewardConfig, config, "config")
  region = completion
  if cfg.require_think or cfg.answer_after_think:
    fmt = check_format(prompt, completion, cfg.think)
    if cfg.require_think and not fmt.passed:
      return RewardResult(value=cfg.format_error_value, info={"reason": f"format:{fmt.reason}"})
    if cfg.answer_after_think and cfg.think.close_tag in completion:
      region = fmt.answer
  found = extract_answer(region, methods=cfg.extract)
  if found is None:
    return RewardResult(value=cfg.incorrect_value, info={"reason": "no_answer"})
  pred, method = found
  info: dict[str, Any] = {"extracted": pred[:200], "method": method}
  if len(pred) > cfg.max_answer_chars:
    return RewardResult(value=cfg.incorrect_value, info={**info, "reason": "answer_too_long"})
  ok = any(is_equivalent(pred, g, backend=cfg.backend) for g in _gold(answer))
  value = cfg.correct_value if ok else cfg.incorrect_value
  return RewardResult(value=value, info={**info, "reason": "correct" if ok else "wrong_answer"})
