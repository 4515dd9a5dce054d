"""Pure score metrics over ``n`` sampled responses per problem: unbiased pass@k, avg@k and maj@k.

Every function takes per-sample correctness (and, for maj@k, the extracted answers) of one problem or of a
``[problems, n]`` table; nothing here generates or scores. ``docs/eval.md`` gives the definitions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl.rewards._math import normalize_answer

KINDS = ("avg", "pass", "maj")
"""Metric kinds a ``--metrics`` spec may name, each as ``KIND@k``."""

DEFAULT_METRICS = "avg@n,pass@1,pass@n,maj@n"
"""What ``jaxrl eval`` reports without ``--metrics`` (with ``--n 16``: avg@16, pass@1, pass@16, maj@16)."""

_SPEC = re.compile(r"^(avg|pass|maj)@(\d+|n|k)$")


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples (Chen et al. 2021, eq. 1).

  ``pass@k = 1 - C(n - c, k) / C(n, k)``: the chance that ``k`` samples drawn without replacement from the
  ``n`` hold at least one correct one. Computed as the product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which
  stays finite where the binomials overflow a float; 1 when ``n - c < k``.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def avg_at_k(correct: Sequence[bool], k: int) -> float:
  """avg@k of one problem: the mean correctness of its first ``k`` samples (DeepScaleR's pass@1 averaged over
  ``k`` samples; equal to pass@1 when ``k = n``)."""
  correct = np.asarray(correct, bool)  # [n]
  if not 1 <= k <= len(correct):
    raise ValueError(f"avg@{k} needs 1 <= k <= n={len(correct)}")
  return float(correct[:k].mean())


def majority_index(answers: Sequence[str | None], k: int,
                   normalize: Callable[[str], str] = normalize_answer) -> int | None:
  """The sample whose answer wins the vote among the first ``k``; ``None`` when none of them has an answer.

  Answers are compared after ``normalize`` (the math reward's :func:`jaxrl.rewards.normalize_answer`); a
  sample without an answer (``None``) does not vote. Ties go to the answer that appeared first (the smallest
  sample index), so the vote depends only on the samples' order; the winner is that answer's first sample.
  """
  if not 1 <= k <= len(answers):
    raise ValueError(f"maj@{k} needs 1 <= k <= n={len(answers)}")
  counts: dict[str, int] = {}
  first: dict[str, int] = {}
  for i, a in enumerate(answers[:k]):
    if a is None:
      continue
    key = normalize(a)
    counts[key] = counts.get(key, 0) + 1
    first.setdefault(key, i)
  if not counts:
    return None
  best = max(counts, key=lambda key: (counts[key], -first[key]))
  return first[best]


def maj_at_k(correct: Sequence[bool], answers: Sequence[str | None], k: int,
             normalize: Callable[[str], str] = normalize_answer) -> float:
  """maj@k of one problem: 1 if the majority answer of the first ``k`` samples (:func:`majority_index`) is
  correct (the correctness of its first sample), else 0; 0 when no sample has an answer."""
  if len(correct) != len(answers):
    raise ValueError(f"maj@k: {len(correct)} correctness values but {len(answers)} answers")
  win = majority_index(answers, k, normalize)
  return 0.0 if win is None else float(bool(correct[win]))


def parse_metrics(spec: str | Sequence[str], n: int) -> list[str]:
  """Metric names from a spec like ``"avg@n,pass@1,pass@16,maj@16"`` (``n`` or ``k`` stands for ``n``).

  Raises:
    ValueError: an unknown kind, a malformed entry, or ``k`` outside ``1..n`` (the message names it).
  """
  items = spec.split(",") if isinstance(spec, str) else list(spec)
  out: list[str] = []
  for item in (s.strip() for s in items):
    m = _SPEC.match(item)
    if not m:
      raise ValueError(f"metric {item!r}: expected KIND@k with KIND in {'/'.join(KINDS)} and k an integer or n")
    k = n if m.group(2) in ("n", "k") else int(m.group(2))
    if not 1 <= k <= n:
      raise ValueError(f"metric {item!r}: k={k} must be in 1..n={n} (samples per problem)")
    name = f"{m.group(1)}@{k}"
    if name not in out:
      out.append(name)
  if not out:
    raise ValueError("no metric named")
  return out


def problem_metrics(correct: Sequence[bool], answers: Sequence[str | None] | None, metrics: Sequence[str],
                    normalize: Callable[[str], str] = normalize_answer) -> dict[str, float]:
  """Each metric of ``metrics`` (names from :func:`parse_metrics`) for one problem's samples."""
  correct = np.asarray(correct, bool)  # [n]
  out = {}
  for name in metrics:
    kind, k = name.split("@")
    k = int(k)
    if kind == "pass":
      out[name] = pass_at_k(len(correct), int(correct.sum()), k)
    elif kind == "avg":
      out[name] = avg_at_k(correct, k)
    elif kind == "maj":
      if answers is None:
        raise ValueError(f"{name} needs the extracted answers")
      out[name] = maj_at_k(correct, answers, k, normalize)
    else:
      raise ValueError(f"unknown metric {name!r}")
  return out


def summarize(correct: Any, metrics: Sequence[str], answers: Sequence[Sequence[str | None]] | None = None,
              normalize: Callable[[str], str] = normalize_answer) -> dict[str, float]:
  """Each metric averaged over problems (every problem weighs the same).

  Args:
    correct: ``[problems, n]`` booleans (a reward above the threshold).
    metrics: names from :func:`parse_metrics` (``pass@1``, ``avg@16``, ``maj@16`` ...).
    answers: ``[problems][n]`` extracted answers (``None`` where none); needed only for maj@k.
    normalize: how answers are compared for the vote.
  """
  correct = np.asarray(correct, bool)  # [P, n]
  if correct.ndim != 2 or not correct.shape[0]:
    raise ValueError(f"correct must be [problems, n] with at least one problem, got shape {correct.shape}")
  rows = [problem_metrics(c, None if answers is None else answers[p], metrics, normalize)
          for p, c in enumerate(correct)]
  return {name: float(np.mean([r[name] for r in rows])) for name in metrics}
