"""Judge-based rewards: LLM-as-judge (pointwise, pairwise), Rubrics as Rewards, Rubric Anchors, AlignXplore.

Every reward here is ``fn(prompt, completion, *, judge, ...)`` with ``judge`` a judge config (a dict in
YAML, see `JudgeConfig`), so a recipe names it like any other reward and combines it with format or
verifier rewards through `weighted_sum` / `gate`. Judge failures raise (`JudgeError`,
`JudgeScoreError`); a `RewardRunner` turns them into the sample's ``error_value`` and counts them.

References: ``shared/seeds/004`` (Rubrics as Rewards: explicit vs implicit aggregation; Reinforcement
Learning with Rubric Anchors: weighted dimensions with score tiers, veto, saturation-aware
aggregation), ``shared/seeds/000`` (AlignXplore, eqs. 6–7).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards._base import RewardResult
from jaxrl.rewards._judge import get_judge
from jaxrl.rewards._base import load_reward

__all__ = [
  "CATEGORY_WEIGHTS",
  "alignxplore_gen_reward",
  "alignxplore_jud_reward",
  "alignxplore_r_gen",
  "alignxplore_r_jud",
  "anchor_aggregate",
  "explicit_rubric_score",
  "judge_reward",
  "pairwise_judge_reward",
  "rubric_anchor_reward",
  "rubric_reward",
]

CATEGORY_WEIGHTS = {"essential": 1.0, "important": 0.7, "optional": 0.3, "pitfall": 0.9}
"""Weights of RaR's criterion categories when an item gives a ``category`` but no ``weight`` (ours: the
notes give the categories, not numbers). Pitfall criteria are phrased as what to avoid, so meeting one
earns credit."""

POINTWISE = ("Rate the response to the prompt from {lo} (worst) to {hi} (best).\n\nPrompt:\n{prompt}\n\n"
             "Response:\n{completion}\n\nReply with 'Score: N'.")
PAIRWISE = ("Which response answers the prompt better?\n\nPrompt:\n{prompt}\n\n[A]\n{a}\n\n[B]\n{b}\n\n"
            "Reply with [[A]] or [[B]].")
CRITERION = ("Does the response meet this criterion?\nCriterion: {criterion}\n\nPrompt:\n{prompt}\n\n"
             "Response:\n{completion}\n\nReply 'Score: 1' if it does, 'Score: 0' if not.")
IMPLICIT = ("Grade the response against the rubric, weighing the criteria by importance, from {lo} to {hi}."
            "\n\nRubric:\n{rubric}\n\nPrompt:\n{prompt}\n\nResponse:\n{completion}\n\nReply with 'Score: N'.")
ANCHOR = ("Grade one dimension of the response.\nDimension: {criterion}\nTiers:\n{tiers}\n\nPrompt:\n{prompt}\n\n"
          "Response:\n{completion}\n\nReply with the tier number as 'Score: N'.")
JUDGE_PREF = ("A user's preference: {description}\n\nThe user's post:\n{post}\n\n[A]\n{a}\n\n[B]\n{b}\n\n"
              "Which response would this user prefer? Reply with [[A]] or [[B]].")


def _user(text: str) -> list[dict[str, str]]:
  return [{"role": "user", "content": text}]


def judge_reward(prompt: str, completion: str, *, judge: Any = None, template: str = POINTWISE, lo: int = 0,
                 hi: int = 9, mode: str = "auto", max_tokens: int | None = None, **_: Any) -> RewardResult:
  """Pointwise LLM-as-judge: ``(s - lo) / (hi - lo)`` for the judge's score ``s`` in ``[lo, hi]``.

  ``template`` is formatted with ``prompt``, ``completion``, ``lo``, ``hi``; ``mode`` chooses text or
  expected-score (log-prob) scoring (`Judge.score`).
  """
  j = get_judge(judge)
  s, info = j.score(_user(template.format(prompt=prompt, completion=completion, lo=lo, hi=hi)), lo=lo, hi=hi,
                    mode=mode, max_tokens=max_tokens)
  return RewardResult(value=(s - lo) / (hi - lo), info={"score": s, **info})


def pairwise_judge_reward(prompt: str, completion: str, *, reference: str, judge: Any = None,
                          template: str = PAIRWISE, swap: bool = True, mode: str = "auto",
                          max_tokens: int | None = None, **_: Any) -> RewardResult:
  """Pairwise LLM-as-judge against the sample's ``reference`` answer: P(completion preferred) in [0, 1].

  With ``swap`` the pair is judged in both orders and the two probabilities averaged (position bias).
  """
  j = get_judge(judge)
  p1, _ = j.choice(_user(template.format(prompt=prompt, a=completion, b=reference)), mode=mode, max_tokens=max_tokens)
  ps = [p1["A"]]
  if swap:
    p2, _ = j.choice(_user(template.format(prompt=prompt, a=reference, b=completion)), mode=mode, max_tokens=max_tokens)
    ps.append(p2["B"])
  return RewardResult(value=sum(ps) / len(ps), info={"p_orders": ps})


def _items(rubric: Any, category_weights: Mapping[str, float]) -> list[tuple[str, float]]:
  if isinstance(rubric, str):
    rubric = [rubric]
  if not isinstance(rubric, Sequence) or not rubric:
    raise ValueError(f"rubric: expected a non-empty list of criteria, got {rubric!r}")
  out = []
  for i, item in enumerate(rubric):
    if isinstance(item, str):
      out.append((item, 1.0))
      continue
    if not isinstance(item, Mapping) or not isinstance(item.get("criterion"), str):
      raise ValueError(f"rubric[{i}]: expected a string or {{criterion, weight|category}}, got {item!r}")
    w = item.get("weight")
    if w is None:
      cat = str(item.get("category", "essential")).lower()
      if cat not in category_weights:
        raise ValueError(f"rubric[{i}].category: {cat!r} is not one of {sorted(category_weights)}")
      w = category_weights[cat]
    if not float(w) > 0:
      raise ValueError(f"rubric[{i}].weight: must be > 0, got {w!r}")
    out.append((item["criterion"], float(w)))
  return out


def explicit_rubric_score(met: Sequence[float], weights: Sequence[float]) -> float:
  """RaR explicit aggregation ``r = Σ_j w_j·m_j / Σ_j w_j`` (``m_j`` in [0, 1]: criterion j met).

  Example:
    >>> explicit_rubric_score([1, 0, 1], [1.0, 0.7, 0.3])
    0.65
  """
  total = sum(weights)
  return sum(w * m for w, m in zip(weights, met, strict=True)) / total


def rubric_reward(prompt: str, completion: str, *, rubric: Any, judge: Any = None, aggregation: str = "implicit",
                  lo: int = 0, hi: int = 9, mode: str = "auto", max_tokens: int | None = None,
                  category_weights: Mapping[str, float] | None = None, **_: Any) -> RewardResult:
  """Rubrics as Rewards. ``rubric`` (usually a dataset field) lists criteria: strings or
  ``{criterion, weight}`` / ``{criterion, category}`` (`CATEGORY_WEIGHTS`).

  * ``aggregation="explicit"``: each criterion judged on its own (met ∈ [0, 1]: a 0/1 score, or
    P(1) from log-probs), combined by `explicit_rubric_score`.
  * ``aggregation="implicit"``: the whole rubric in one judge prompt, holistic score normalised to [0, 1].
  """
  items = _items(rubric, {**CATEGORY_WEIGHTS, **(category_weights or {})})
  j = get_judge(judge)
  if aggregation == "explicit":
    met = [j.score(_user(CRITERION.format(criterion=c, prompt=prompt, completion=completion)), lo=0, hi=1,
                   mode=mode, max_tokens=max_tokens)[0] for c, _ in items]
    value = explicit_rubric_score(met, [w for _, w in items])
    return RewardResult(value=value, info={"met": met})
  if aggregation != "implicit":
    raise ValueError(f"aggregation: {aggregation!r} is not 'explicit' or 'implicit'")
  text = "\n".join(f"- ({w:g}) {c}" for c, w in items)
  s, info = j.score(_user(IMPLICIT.format(rubric=text, prompt=prompt, completion=completion, lo=lo, hi=hi)),
                    lo=lo, hi=hi, mode=mode, max_tokens=max_tokens)
  return RewardResult(value=(s - lo) / (hi - lo), info={"score": s, **info})


def anchor_aggregate(scores: Sequence[float], weights: Sequence[float], *, veto: Sequence[bool] | None = None,
                     caps: Sequence[float] | None = None, veto_threshold: float = 0.5,
                     veto_value: float = 0.0) -> float:
  """Rubric Anchors aggregation of per-dimension scores ``s_d ∈ [0, 1]``:

  ``R = veto_value`` if any veto dimension has ``s_d < veto_threshold``; else
  ``R = Σ_d w_d·min(s_d, c_d)/c_d / Σ_d w_d`` (saturation: past its cap ``c_d`` a dimension adds nothing).

  Example:
    >>> anchor_aggregate([1.0, 0.5], [1.0, 1.0], caps=[0.8, 1.0])
    0.75
  """
  n = len(scores)
  veto = list(veto or [False] * n)
  caps = list(caps or [1.0] * n)
  if not len(weights) == len(veto) == len(caps) == n:
    raise ValueError("anchor_aggregate: scores, weights, veto and caps must have one entry per dimension")
  if any(v and s < veto_threshold for s, v in zip(scores, veto)):
    return float(veto_value)
  return sum(w * min(s, c) / c for s, w, c in zip(scores, weights, caps)) / sum(weights)


def rubric_anchor_reward(prompt: str, completion: str, *, dimensions: Sequence[Mapping[str, Any]], judge: Any = None,
                         veto_threshold: float = 0.5, veto_value: float = 0.0, mode: str = "auto",
                         max_tokens: int | None = None, **_: Any) -> RewardResult:
  """Rubric Anchors (Rubicon): each dimension ``{criterion, tiers: [tier 0, ..., tier L], weight=1,
  veto=False, cap=1}`` is judged to a tier ``t`` (score ``t / L``), then `anchor_aggregate`.
  A reward-hacking defence rubric is a ``veto`` dimension."""
  if not dimensions:
    raise ValueError("dimensions: need at least one {criterion, tiers}")
  j = get_judge(judge)
  scores, weights, veto, caps = [], [], [], []
  for i, d in enumerate(dimensions):
    tiers = d.get("tiers")
    if not isinstance(d.get("criterion"), str) or not isinstance(tiers, Sequence) or len(tiers) < 2:
      raise ValueError(f"dimensions[{i}]: needs a criterion and at least two tiers")
    top = len(tiers) - 1
    listing = "\n".join(f"{t}: {desc}" for t, desc in enumerate(tiers))
    s, _ = j.score(_user(ANCHOR.format(criterion=d["criterion"], tiers=listing, prompt=prompt, completion=completion)),
                   lo=0, hi=top, mode=mode, max_tokens=max_tokens)
    scores.append(s / top)
    weights.append(float(d.get("weight", 1.0)))
    veto.append(bool(d.get("veto", False)))
    caps.append(float(d.get("cap", 1.0)))
  value = anchor_aggregate(scores, weights, veto=veto, caps=caps, veto_threshold=veto_threshold, veto_value=veto_value)
  return RewardResult(value=value, info={"dimension_scores": scores})


# --------------------------------------------------------------------------------------------------
# AlignXplore (shared/seeds/000, eqs. 4–7)


def alignxplore_r_gen(lp_w_given_d: float, lp_w: float, lp_l_given_d: float, lp_l: float, format_ok: bool) -> float:
  """Eq. 6: ``R_gen = 1(log R(y_w|x,d)/R(y_w|x) > log R(y_l|x,d)/R(y_l|x)) · R_format``.

  Args are sequence log-probs ``log R(y|x, d)`` and ``log R(y|x)`` of the chosen (w) and rejected (l)
  responses under the downstream generator R.

  Example:
    >>> alignxplore_r_gen(-10.0, -12.0, -9.0, -10.0, True)   # margins 2 > 1
    1.0
  """
  return float((lp_w_given_d - lp_w) > (lp_l_given_d - lp_l)) * float(bool(format_ok))


def alignxplore_r_jud(p_w: float, p_l: float, format_ok: bool) -> float:
  """Eq. 7: ``R_jud = 1(R_jud(y_w|x,d,y_w,y_l) > R_jud(y_l|x,d,y_w,y_l)) · R_format``.

  Example:
    >>> alignxplore_r_jud(0.6, 0.4, True), alignxplore_r_jud(0.6, 0.4, False)
    (1.0, 0.0)
  """
  return float(p_w > p_l) * float(bool(format_ok))


_PREF = re.compile(r"<think>(?P<r>.*?)</think>\s*<preference>(?P<d>.*?)</preference>", re.S)


def _description(completion: str) -> tuple[str, bool]:
  """R_format: a non-empty ``<think>r</think>`` then a non-empty ``<preference>d</preference>``."""
  m = _PREF.search(completion)
  ok = bool(m and m.group("r").strip() and m.group("d").strip())
  return (m.group("d").strip() if ok else ""), ok


def alignxplore_jud_reward(prompt: str, completion: str, *, post: str, chosen: str, rejected: str, judge: Any = None,
                           swap: bool = True, mode: str = "auto", max_tokens: int | None = None,
                           **_: Any) -> RewardResult:
  """AlignXplore's R_jud for an inferred preference description (the completion's ``<preference>``):
  the judge sees ``d``, the user's ``post`` and both responses; with ``swap`` the two orders' probabilities
  are averaged. Sample fields: ``post``, ``chosen`` (y_w), ``rejected`` (y_l)."""
  d, ok = _description(completion)
  if not ok:
    return RewardResult(value=0.0, info={"reason": "format"})
  j = get_judge(judge)
  p1, _ = j.choice(_user(JUDGE_PREF.format(description=d, post=post, a=chosen, b=rejected)), mode=mode,
                   max_tokens=max_tokens)
  pw, pl = [p1["A"]], [p1["B"]]
  if swap:
    p2, _ = j.choice(_user(JUDGE_PREF.format(description=d, post=post, a=rejected, b=chosen)), mode=mode,
                     max_tokens=max_tokens)
    pw.append(p2["B"])
    pl.append(p2["A"])
  p_w, p_l = sum(pw) / len(pw), sum(pl) / len(pl)
  return RewardResult(value=alignxplore_r_jud(p_w, p_l, ok), info={"p_w": p_w, "p_l": p_l})


def alignxplore_gen_reward(prompt: str, completion: str, *, post: str, chosen: str, rejected: str, logprob_fn: Any,
                           condition: str = "User preference: {description}\n\n{post}", **_: Any) -> RewardResult:
  """AlignXplore's R_gen: ``logprob_fn(context, continuation) -> float`` (an import path or callable: the
  summed log-prob of ``continuation`` after ``context`` under the downstream generator, e.g. a local
  jaxrl model; or a judge config dict: `Judge.sequence_logprob` on a server that returns prompt
  log-probs with ``echo``, such as vLLM) scores y_w and y_l with and without the description (eq. 6)."""

  d, ok = _description(completion)
  if not ok:
    return RewardResult(value=0.0, info={"reason": "format"})
  fn = get_judge(logprob_fn).sequence_logprob if isinstance(logprob_fn, Mapping) else load_reward(logprob_fn)
  ctx_d = condition.format(description=d, post=post)
  lps = [fn(ctx_d, chosen), fn(post, chosen), fn(ctx_d, rejected), fn(post, rejected)]
  return RewardResult(value=alignxplore_r_gen(*lps, ok), info={"logprobs": lps})
