"""What a judge answers and how it is read: the response record, the two judge errors, and score parsing.

Pure functions over text and token log-probs (`parse_score`, `parse_choice`, `expected_score`); no I/O,
no state. `jaxrl.rewards._judge` (the client) builds `JudgeResponse` records and raises the errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence

__all__ = ["JudgeError", "JudgeResponse", "JudgeScoreError", "expected_score", "parse_choice", "parse_score"]


class JudgeError(RuntimeError):
  """A judge request failed for good; ``reason`` is ``http_<status>``, ``timeout``, ``connection`` ..."""

  def __init__(self, reason: str, message: str):
    super().__init__(f"judge {reason}: {message}")
    self.reason = reason


class JudgeScoreError(ValueError):
  """The judge answered but no score could be read from the answer."""

  def __init__(self, text: str):
    super().__init__(f"judge: no score in the response {text[:120]!r}")
    self.reason = "judge_no_score"


@dataclasses.dataclass(frozen=True)
class JudgeResponse:
  """Text of the first choice, with per-token top log-probs when requested and allowed."""

  text: str
  top_logprobs: list[dict[str, float]] | None
  """Per generated token: ``{token_text: logprob}`` of its top alternatives (None: text only)."""
  tokens: list[str] | None
  prompt_tokens: int = 0
  completion_tokens: int = 0
  cached: bool = False


_SCORE = re.compile(r"(?i)\b(?:score|rating|grade)\b\s*(?:is|of)?\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?")
_JSON = re.compile(r"\{[^{}]*\}")


def parse_score(text: str, *, hi: float | None = None) -> float | None:
  """The score in a judge's answer, or None.

  Reads, in order: a JSON object with a ``score`` (or ``rating``) field; the last ``Score: 7``,
  ``Score: 7/10`` or ``rating = 3.5``; a lone number as the whole answer. ``x/d`` with ``d != hi``
  is rescaled to ``x / d · hi``.

  Example:
    >>> parse_score("Reasoning ... Score: 7/10", hi=10)
    7.0
    >>> parse_score('{"reason": "ok", "score": 4}')
    4.0
  """
  for m in reversed(_JSON.findall(text)):
    try:
      obj = json.loads(m)
    except ValueError:
      continue
    for k in ("score", "rating"):
      if isinstance(obj.get(k), (int, float)) and not isinstance(obj.get(k), bool):
        return float(obj[k])
  hits = _SCORE.findall(text)
  if hits:
    value, den = hits[-1]
    v = float(value)
    if den and hi is not None and float(den) != float(hi) and float(den) > 0:
      v = v / float(den) * hi
    return v
  stripped = text.strip().rstrip(".")
  if re.fullmatch(r"-?\d+(?:\.\d+)?", stripped):
    return float(stripped)
  return None


def parse_choice(text: str, options: str = "AB") -> str | None:
  """The option letter a judge chose: ``[[A]]``, ``Answer: B``, ``(A)`` or a lone letter; None if unclear.

  Example:
    >>> parse_choice("Both are fine but [[B]] is better.")
    'B'
  """
  opts = re.escape(options)
  for pat in (rf"\[\[([{opts}])\]\]", rf"(?i)(?:answer|choice|verdict|winner|better|prefer\w*)\s*(?:is)?\s*[:=]?\s*\(?\**([{opts}])\b",
              rf"^\s*\(?([{opts}])\)?\s*\.?\s*$"):
    m = re.findall(pat, text, flags=re.MULTILINE)
    if m:
      return m[-1]
  return None


def expected_score(top_logprobs: Sequence[Mapping[str, float]], *, lo: int = 0, hi: int = 9) -> float | None:
  """``E[s] = Σ_s s·p(s) / Σ_s p(s)`` over the score tokens ``lo..hi`` at the first generated position
  whose top log-probs contain one; None when no position does.

  Each score must be a single token (digits on every common tokenizer for ``0..9``).

  Example:
    >>> round(expected_score([{"7": math.log(0.5), "8": math.log(0.25), "x": math.log(0.25)}]), 4)
    7.3333
  """
  for top in top_logprobs:
    probs = {}
    for tok, lp in top.items():
      t = tok.strip()
      if re.fullmatch(r"-?\d+", t) and lo <= int(t) <= hi:
        probs[int(t)] = probs.get(int(t), 0.0) + math.exp(lp)
    total = sum(probs.values())
    if total > 0:
      return sum(s * p for s, p in probs.items()) / total
  return None

