"""Helpers of the ``jaxrl eval`` tests: a reward with mixed verdicts on a random model, and independent
reference metrics recomputed from the records."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from fractions import Fraction
from math import comb
from pathlib import Path

from jaxrl import rewards


def length_mod3_math(prompt: str, completion: str, *, answer, **_):
  """The math reward of the answer ``\\boxed{len(completion) % 3}``: a random model's responses get mixed
  verdicts and extracted answers, through the real extraction and equivalence check."""
  return rewards.math_reward(prompt, f"\\boxed{{{len(completion) % 3}}}", answer=answer,
                             config={"require_think": False})


def pass_at_k_comb(n: int, c: int, k: int) -> Fraction:
  """Chen et al.'s closed form, exactly: ``1 - C(n - c, k) / C(n, k)``."""
  return 1 - Fraction(comb(n - c, k), comb(n, k))


def pass_at_k_enum(correct: list[bool], k: int) -> Fraction:
  """Fraction of all k-subsets of the samples that hold a correct one."""
  subsets = list(itertools.combinations(range(len(correct)), k))
  return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def maj_reference(correct: list[bool], answers: list, k: int) -> float:
  """Majority vote with Counter over normalised answers; ties to the answer seen first."""
  keys = [None if a is None else rewards.normalize_answer(a) for a in answers[:k]]
  counts = Counter(x for x in keys if x is not None)
  if not counts:
    return 0.0
  top = max(counts.values())
  winner = next(x for x in keys if x is not None and counts[x] == top)
  return float(correct[keys.index(winner)])


def read_jsonl(path: Path) -> list[dict]:
  """The JSON objects of a JSONL file, in order."""
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
