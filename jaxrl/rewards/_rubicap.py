"""RubiCap: per-image rubrics from a teacher committee and the weighted rubric reward (shared/seeds/004,
RubiCap "方法"; the consensus, severity and reward rules are the notes').

Rubric synthesis (offline, ``jaxrl rubicap-rubrics``) asks a rubric-writer LLM for the student caption's
failures against what the teachers agree on; `parse_rubric_reply` keeps a rubric only when at least
``min_support`` (2) distinct teachers state its fact, checked deterministically: each supporting teacher
comes with a quote that must occur in that teacher's caption (case and whitespace folded). Severities weigh
critical 3.0, important 2.0, minor 1.0.

The reward (`rubicap_reward`) has an LLM judge check each binary rubric on the rollout and returns the
weighted, normalised fraction satisfied, ``Σ_j w_j·m_j / Σ_j w_j`` (`explicit_rubric_score`, through
`rubric_reward`). It also measures the rollout's self-praise phrases and length (``info["monitor"]``, logged
by the RL trainer as ``reward/monitor/*``): holistic judges teach captions such as "This description is
absolutely correct and complete", and a rubric reward must be seen not to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards._base import RewardResult, load_reward
from jaxrl.rewards._rubric import explicit_rubric_score, rubric_reward

__all__ = ["SELF_PRAISE_PATTERNS", "SEVERITY_WEIGHTS", "caption_monitor", "parse_rubric_reply", "read_rubric_lines",
           "rubicap_reward", "severity_weight", "supported_by"]

SEVERITY_WEIGHTS = {"critical": 3.0, "important": 2.0, "minor": 1.0}
"""RubiCap's severity weights: critical failures (wrong main object, hallucinated major element, missing key
relation), important gaps (missing secondary object, wrong attribute or spatial relation), minor polish."""

SELF_PRAISE_PATTERNS = (
  r"\b(?:absolutely|completely|entirely|fully|perfectly) (?:correct|accurate|complete)",
  r"\bthis (?:image )?(?:detailed |comprehensive )?(?:description|caption) (?:is|should|provides|captures|covers|"
  r"ensures|will|can)\b",
  r"\b(?:accurate|correct) and (?:complete|comprehensive|detailed)\b",
  r"\bhelp(?:s)? (?:a|the|any) (?:text|language|reader)",
  r"\bany (?:related|relevant) questions?\b",
  r"\bI hope this\b",
)
"""Phrases of captions that praise themselves (the notes' examples and CapRL's meta-commentary)."""


def severity_weight(value: Any, where: str = "severity") -> float:
  """The weight of a severity name (``critical``/``important``/``minor``, any case) or of the numbers 3/2/1.
  Raises ValueError naming `where` for anything else."""
  if isinstance(value, str) and value.strip().lower() in SEVERITY_WEIGHTS:
    return SEVERITY_WEIGHTS[value.strip().lower()]
  if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) in SEVERITY_WEIGHTS.values():
    return float(value)
  raise ValueError(f"{where}: {value!r} is not one of {list(SEVERITY_WEIGHTS)} (or 3/2/1)")


def _fold(text: str) -> str:
  return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def supported_by(support: Any, teachers: Sequence[str], *, where: str) -> list[int]:
  """The distinct teachers (1-based) whose caption contains the quote the writer gave for them: `support` is a
  list of ``{teacher: i, quote: "..."}``. Raises ValueError for a malformed entry or a teacher out of range."""
  if not isinstance(support, Sequence) or isinstance(support, str):
    raise ValueError(f"{where}.support: expected a list of {{teacher, quote}}, got {support!r:.80}")
  found = set()
  for k, s in enumerate(support):
    if not isinstance(s, Mapping) or not isinstance(s.get("quote"), str) or isinstance(s.get("teacher"), bool):
      raise ValueError(f"{where}.support[{k}]: expected {{teacher, quote}}, got {s!r:.80}")
    t = s.get("teacher")
    if not isinstance(t, int) or not 1 <= t <= len(teachers):
      raise ValueError(f"{where}.support[{k}].teacher: {t!r} is not a teacher number 1..{len(teachers)}")
    quote = _fold(s["quote"])
    if quote and quote in _fold(teachers[t - 1]):
      found.add(t)
  return sorted(found)


def parse_rubric_reply(text: str, teachers: Sequence[str], *, min_support: int = 2,
                       where: str = "reply") -> tuple[list[dict[str, Any]], dict[str, int]]:
  """The rubrics of a rubric writer's JSON answer ``{"rubrics": [{criterion, severity, support}]}`` that pass
  the consensus rule (at least `min_support` teachers verified by `supported_by`), each as
  ``{criterion, severity, weight, teachers}``; and counts (``proposed``, ``unsupported``).

  The JSON may sit in a fenced block or among other text (the outermost ``{...}`` is read). Raises ValueError
  naming `where` for unreadable JSON, a missing field, or an unknown severity."""
  start, end = text.find("{"), text.rfind("}")
  try:
    obj = json.loads(text[start:end + 1]) if start >= 0 else None
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: the rubric writer's answer is not JSON ({e.msg} at char {start + e.pos})") from None
  if not isinstance(obj, Mapping) or not isinstance(obj.get("rubrics"), list):
    raise ValueError(f"{where}: expected a JSON object with a 'rubrics' list, got {text[:80]!r}")
  kept, unsupported = [], 0
  for i, r in enumerate(obj["rubrics"]):
    at = f"{where}.rubrics[{i}]"
    if not isinstance(r, Mapping) or not isinstance(r.get("criterion"), str) or not r["criterion"].strip():
      raise ValueError(f"{at}: expected {{criterion, severity, support}}, got {r!r:.80}")
    weight = severity_weight(r.get("severity"), f"{at}.severity")
    support = supported_by(r.get("support"), teachers, where=at)
    if len(support) < min_support:
      unsupported += 1
      continue
    kept.append({"criterion": r["criterion"].strip(), "severity": str(r["severity"]).strip().lower()
                 if isinstance(r["severity"], str) else _name(weight), "weight": weight, "teachers": support})
  return kept, {"proposed": len(obj["rubrics"]), "unsupported": unsupported}


def _name(weight: float) -> str:
  return {w: k for k, w in SEVERITY_WEIGHTS.items()}[weight]


def read_rubric_lines(lines: Sequence[str], source: str) -> list[list[dict[str, Any]]]:
  """Per-image rubric lists from JSONL lines ``{"rubrics": [{criterion, severity}]}`` (what
  ``jaxrl rubicap-rubrics`` writes); a malformed line raises ValueError naming ``source:line``."""
  out = []
  for n, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{source}:{n}: not JSON ({e.msg})") from None
    out.append(_items(rec.get("rubrics") if isinstance(rec, Mapping) else None, f"{source}:{n}"))
  return out


def _items(rubrics: Any, where: str) -> list[dict[str, Any]]:
  if not isinstance(rubrics, list):
    raise ValueError(f"{where}: expected a 'rubrics' list of {{criterion, severity}}, got {rubrics!r:.80}")
  items = []
  for i, r in enumerate(rubrics):
    if not isinstance(r, Mapping) or not isinstance(r.get("criterion"), str):
      raise ValueError(f"{where}: rubrics[{i}]: expected {{criterion, severity}}, got {r!r:.80}")
    w = severity_weight(r.get("severity", r.get("weight")), f"{where}: rubrics[{i}].severity")
    items.append({"criterion": r["criterion"], "weight": w})
  return items


def caption_monitor(caption: str, patterns: Sequence[str] = SELF_PRAISE_PATTERNS) -> dict[str, float]:
  """``{"self_praise": 1.0 if any of `patterns` occurs (case-insensitive) else 0.0, "words": word count}``;
  averaged over a batch these are the fraction of self-praising captions and the mean length."""
  praise = any(re.search(p, caption, re.I) for p in patterns)
  return {"self_praise": float(praise), "words": float(len(caption.split()))}


def rubicap_reward(prompt: str, completion: str, *, rubrics: Any, judge: Any = None, mode: str = "auto",
                   max_tokens: int | None = None, empty_value: float = 1.0,
                   self_praise_patterns: Sequence[str] = SELF_PRAISE_PATTERNS, checker: Any = None,
                   **_: Any) -> RewardResult:
  """RubiCap's reward: ``Σ_j w_j·m_j / Σ_j w_j`` over the image's `rubrics` (``{criterion, severity}``,
  severity weights `SEVERITY_WEIGHTS`), each judged met (``m_j`` ∈ [0, 1]) by `judge` on the caption
  `completion` (`rubric_reward` with explicit aggregation). An image without rubrics (the student had no
  failure) scores `empty_value`. ``info["monitor"]``: `caption_monitor` of the caption.

  ``checker``: instead of the LLM judge, an in-process ``fn(criterion, caption) -> m ∈ [0, 1]`` or its import
  path (``jaxrl.rewards:scene_rubric_check`` for the built-in caption task's rubrics); same weighting."""
  items = _items(rubrics, "rubrics")
  monitor = caption_monitor(completion, self_praise_patterns)
  if not items:
    return RewardResult(value=float(empty_value), info={"reason": "no_rubrics", "met": [], "monitor": monitor})
  if checker is not None:
    check = load_reward(checker)
    met = [float(check(r["criterion"], completion)) for r in items]
    return RewardResult(value=explicit_rubric_score(met, [r["weight"] for r in items]),
                        info={"met": met, "monitor": monitor})
  res = rubric_reward(prompt, completion, rubric=items, judge=judge, aggregation="explicit", mode=mode,
                      max_tokens=max_tokens)
  return RewardResult(value=res.value, info={**res.info, "monitor": monitor})
