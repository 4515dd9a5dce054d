"""Auto-Rubric: propose–evaluate–revise rubrics per preference pair, then query-agnostic selection by coding rate.

Reference: ``shared/seeds/000`` (Auto-Rubric), eqs. 3–11.

* Per pair ``(x, y+, y-)``: a judge proposes a rubric set ``R^(0)`` (eq. 3); the judge, guided by the
  rubric, predicts which response is better (eq. 4); on a wrong prediction the failed set is revised
  (eq. 5), at most ``E_max`` times. Verified sets go into the pool.
* Selection: greedily add the rubric with the largest coding-rate gain (eq. 8) of
  ``C(E, ε) = ½ log det(I + EᵀE / (ε² |R|))`` (eq. 6, ``E`` the ``d × |R|`` matrix of unit-norm
  embeddings), stopping once the gain has stayed below ``τ_min`` for ``patience`` consecutive steps
  (τ_min = 0.002, patience 2 in the notes); those low-gain picks are dropped.
* Analysis: coverage, precision and contribution of each selected rubric (eqs. 9–11).

Embeddings come from a pluggable ``embed(texts) -> [n, d]``. `default_embedder` picks
`WordLlamaEmbedder` when the optional ``wordllama`` package is installed (``pip install jaxrl[embed]``):
static token embeddings distilled from an LLM, 256-d, whose weights (16 MB) and tokenizer ship inside
the wheel and load with no network (numpy + safetensors + tokenizers, no PyTorch). Otherwise it falls
back to `HashingEmbedder`, a deterministic bag of hashed word unigrams and bigrams (no model): rubrics
that share words are close, near-duplicates nearly collinear, synonyms are not. Any other model plugs
in the same way (e.g. ``SentenceTransformer(...).encode``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl import _extras
from jaxrl.rewards._judge import get_judge
from jaxrl.rewards._judge_parse import parse_choice

__all__ = [
  "HashingEmbedder",
  "RubricSelection",
  "WordLlamaEmbedder",
  "default_embedder",
  "select_rubric_texts",
  "coding_rate",
  "propose_evaluate_revise",
  "rubric_metrics",
  "select_rubrics",
]


def coding_rate(E: np.ndarray, eps: float) -> float:
  """``C(E, ε) = ½ log det(I + EᵀE / (ε² |R|))`` for embeddings ``E`` of shape ``[d, |R|]`` (float64).

  Computed on the ``|R| × |R|`` Gram matrix with a Cholesky factor (it is positive definite).

  Example:
    >>> round(coding_rate(np.eye(3)[:, :2], 1.0), 6)   # ½·2·log(1 + 1/2)
    0.405465
  """
  E = np.asarray(E, np.float64)
  r = E.shape[1]
  if r == 0:
    return 0.0
  gram = np.eye(r) + E.T @ E / (eps**2 * r)
  return float(np.sum(np.log(np.diag(np.linalg.cholesky(gram)))))


_TIE = 1e-12


@dataclasses.dataclass(frozen=True)
class RubricSelection:
  """Result of `select_rubrics`: chosen indices in pick order, each pick's gain, and ``C`` after each."""

  indices: list[int]
  gains: list[float]
  rates: list[float]
  stopped_early: bool


def select_rubrics(embeddings: np.ndarray, *, eps: float = 0.5, tau_min: float = 0.002, patience: int = 2,
                   max_size: int | None = None) -> RubricSelection:
  """Greedy coding-rate maximisation (eq. 8) with the early stop of the notes.

  Args:
    embeddings: ``[n, d]`` rubric embeddings (rows; normalised to unit length here).
    eps: ε of eq. 6 (ours: the notes do not give it).
    tau_min: a gain below this counts toward the stop.
    (Candidates whose rates tie up to 1e-12 are taken in index order.)
    patience: consecutive low-gain picks that stop the selection; they are removed from the result.
    max_size: most rubrics (``m`` of eq. 7).
  """
  X = np.asarray(embeddings, np.float64)
  X = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)
  n = X.shape[0]
  chosen, gains, rates, low = [], [], [], 0
  current = 0.0
  limit = n if max_size is None else min(n, max_size)
  while len(chosen) < limit:
    cand = {i: coding_rate(X[chosen + [i]].T, eps) for i in range(n) if i not in chosen}
    top = max(cand.values())
    best = min(i for i, v in cand.items() if v >= top - _TIE)  # ties (equal up to rounding): lowest index
    best_rate = cand[best]
    gain = best_rate - current
    chosen.append(best)
    gains.append(gain)
    rates.append(best_rate)
    current = best_rate
    low = low + 1 if gain < tau_min else 0
    if low >= patience:
      return RubricSelection(chosen[:-patience], gains[:-patience], rates[:-patience], True)
  return RubricSelection(chosen, gains, rates, False)


class HashingEmbedder:
  """Deterministic text embeddings: signed hashed counts of lower-cased word unigrams and bigrams, ``dim`` wide."""

  def __init__(self, dim: int = 256):
    self.dim = dim

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    out = np.zeros((len(texts), self.dim), np.float64)
    for row, text in enumerate(texts):
      words = re.findall(r"[a-z0-9]+", text.lower())
      for feat in words + [a + " " + b for a, b in zip(words, words[1:])]:
        h = int.from_bytes(hashlib.blake2b(feat.encode(), digest_size=8).digest(), "little")
        out[row, h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
    return out


class WordLlamaEmbedder:
  """Sentence embeddings from WordLlama (``wordllama==0.4.0.post1``, the ``embed`` extra): the packaged
  ``l2_supercat`` static embeddings (``dim`` in 64, 128, 256: truncated Matryoshka dimensions), read
  from the installed package only (downloads disabled)."""

  name = "wordllama-l2_supercat"

  def __init__(self, dim: int = 256):
    from pathlib import Path

    wordllama = _extras.require("wordllama")  # optional (the embed extra)
    WordLlama = wordllama.WordLlama

    self.dim = dim
    # The package's own files (weights/, tokenizers/) act as the cache; nothing is fetched.
    self._model = WordLlama.load(cache_dir=Path(wordllama.__file__).parent, disable_download=True,
                                 trunc_dim=None if dim == 256 else dim)

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    return np.asarray(self._model.embed(list(texts)), np.float64)


def default_embedder() -> tuple[Callable[[Sequence[str]], np.ndarray], str]:
  """``(embed, name)``: `WordLlamaEmbedder` when ``wordllama`` is installed, else `HashingEmbedder`
  (``name`` says which, e.g. for a run's log: ``"hashing (wordllama not installed)"``)."""
  try:
    emb = WordLlamaEmbedder()
  except ImportError:
    return HashingEmbedder(), "hashing (wordllama not installed)"
  return emb, emb.name


def select_rubric_texts(rubrics: Sequence[str], *, embed: Callable[[Sequence[str]], np.ndarray] | None = None,
                        **kwargs) -> tuple[list[str], RubricSelection, str]:
  """`select_rubrics` over rubric texts embedded with ``embed`` (default: `default_embedder`); returns
  the selected texts in pick order, the selection, and the embedder's name."""
  if embed is None:
    embed, name = default_embedder()
  else:
    name = getattr(embed, "name", type(embed).__name__)
  sel = select_rubrics(np.asarray(embed(list(rubrics)), np.float64), **kwargs)
  return [rubrics[i] for i in sel.indices], sel, name


PROPOSE = ("A user preferred response A over response B.\n\nQuery:\n{x}\n\n[A]\n{yp}\n\n[B]\n{ym}\n\n"
           "Write 1-5 short, general rubric items (one per line, starting with '- ') that explain the preference.")
REVISE = ("These rubric items failed to make a grader prefer A:\n{rubrics}\n\nQuery:\n{x}\n\n[A]\n{yp}\n\n[B]\n{ym}\n\n"
          "Write improved rubric items (one per line, starting with '- ').")
EVALUATE = ("Rubric:\n{rubrics}\n\nQuery:\n{x}\n\n[A]\n{a}\n\n[B]\n{b}\n\nFollowing the rubric, which response is "
            "better? Reply with [[A]] or [[B]], or [[T]] for a tie.")


def _lines(text: str) -> list[str]:
  return [m.strip() for m in re.findall(r"^\s*[-*]\s*(.+)$", text, flags=re.M) if m.strip()]


def _prefers(judge, rubrics: Sequence[str], x: str, a: str, b: str) -> str | None:
  """``"A"``, ``"B"``, ``"T"`` (tie) or None (no readable verdict)."""
  listing = "\n".join(f"- {r}" for r in rubrics)
  resp = judge.chat([{"role": "user", "content": EVALUATE.format(rubrics=listing, x=x, a=a, b=b)}])
  return parse_choice(resp.text, "ABT")


def propose_evaluate_revise(x: str, y_plus: str, y_minus: str, *, judge: Any = None, e_max: int = 10
                            ) -> tuple[list[str], bool, int]:
  """Eqs. 3–5 for one pair: returns ``(rubrics, verified, rounds)``; unverified sets should stay out of the pool."""
  j = get_judge(judge)
  rubrics = _lines(j.chat([{"role": "user", "content": PROPOSE.format(x=x, yp=y_plus, ym=y_minus)}]).text)
  for t in range(e_max):
    if rubrics and _prefers(j, rubrics, x, y_plus, y_minus) == "A":
      return rubrics, True, t + 1
    listing = "\n".join(f"- {r}" for r in rubrics)
    rubrics = _lines(j.chat([{"role": "user", "content": REVISE.format(rubrics=listing, x=x, yp=y_plus,
                                                                        ym=y_minus)}]).text) or rubrics
  return rubrics, False, e_max


def rubric_metrics(rubrics: Sequence[str], pairs: Sequence[tuple[str, str, str]],
                   evaluate: Callable[[Sequence[str], str, str, str], str | None]) -> list[dict[str, float]]:
  """Coverage, precision and contribution (eqs. 9–11) of each rubric on test pairs ``(x, y+, y-)``.

  ``evaluate(rubric_set, x, a, b)`` returns ``"A"``, ``"B"`` or ``"T"``/None (a tie); the preferred
  response is always shown as A here. Coverage = share of pairs where the rubric alone is not a tie;
  precision = share of those it gets right; contribution = Acc(all) − Acc(all without it).
  """
  def acc(rs):
    return float(np.mean([evaluate(rs, x, yp, ym) == "A" for x, yp, ym in pairs]))

  full = acc(list(rubrics))
  out = []
  for i, r in enumerate(rubrics):
    verdicts = [evaluate([r], x, yp, ym) for x, yp, ym in pairs]
    decided = [v for v in verdicts if v in ("A", "B")]
    out.append({"coverage": len(decided) / len(pairs),
                "precision": (sum(v == "A" for v in decided) / len(decided)) if decided else float("nan"),
                "contribution": full - acc([q for k, q in enumerate(rubrics) if k != i])})
  return out
