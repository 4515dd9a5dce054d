"""Rubric-ARM's two rewards: the judge's (preference accuracy + format) and the rubric generator's.

Rubric-ARM (``shared/seeds/004``, "Alternating Reinforcement Learning for Rubric-Based Reward Modeling")
trains two policies on preference pairs ``(x, y_w, y_l)``: a rubric generator ``π_r(rubric | x)`` and a
judge ``π_j(reasoning, verdict | x, rubric, A, B)``, alternately with GRPO, each while the other is frozen.

* **Judge** (the rubric generator frozen; its rubrics cached for the phase): the pair is shown in a
  random order, ``label`` names the position (``A``/``B``) of ``y_w``, and
  ``R_jud = R_acc + w_fmt · R_fmt`` with ``R_acc = 1(verdict = label)`` ("is the predicted preference
  right") and ``R_fmt = 1(the output is a non-empty justification ending in one [[A]] or [[B]])``. The
  notes name the two parts and not their weighting: the sum with ``w_fmt`` (default 0.5) is ours.
* **Rubric generator** (the judge frozen): ``R_gen = 1(verdict = label)`` of the frozen judge reading the
  generated rubric; with ``orders="both"`` the judge sees the pair in both orders and ``R_gen`` is the
  mean of the two correctness bits (in {0, ½, 1}), so a rubric cannot profit from the judge's position
  bias (the notes use order-swapped evaluation against position bias).

The verdict is read with `parse_choice` (``[[A]]``, ``Answer: B``, a lone letter); no verdict counts as
wrong. The alternating loop lives in `jaxrl.rl.RubricARM`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from jaxrl.rewards._base import RewardResult
from jaxrl.rewards._judge_parse import parse_choice

__all__ = [
  "RUBRIC_ARM_JUDGE_TEMPLATE",
  "judge_format_ok",
  "rubric_arm_generator_reward",
  "rubric_arm_judge_prompts",
  "rubric_arm_judge_reward",
  "rubric_arm_judge_value",
]

RUBRIC_ARM_JUDGE_TEMPLATE = ("Rubric:\n{rubric}\n\nPrompt:\n{question}\n\n[A]\n{a}\n\n[B]\n{b}\n\n"
                             "Check each criterion, justify, then end with [[A]] or [[B]].")
"""The judge's prompt; formatted with ``rubric``, ``question`` (the pair's prompt), ``a`` and ``b``."""

_FINAL = re.compile(r"\[\[([AB])\]\]\s*$")
_ANY = re.compile(r"\[\[[AB]\]\]")


def judge_format_ok(text: str) -> bool:
  """``R_fmt``: a non-empty justification followed by exactly one ``[[A]]``/``[[B]]``, at the very end.

  Example:
    >>> judge_format_ok("meets the criterion. [[A]]"), judge_format_ok("[[A]]"), judge_format_ok("[[A]] ok")
    (True, False, False)
  """
  m = _FINAL.search(text)
  return bool(m and len(_ANY.findall(text)) == 1 and text[:m.start()].strip())


def rubric_arm_judge_value(verdict: str | None, label: str, format_ok: bool, *, format_weight: float) -> float:
  """``R_jud = 1(verdict = label) + format_weight · 1(format_ok)``.

  Example:
    >>> rubric_arm_judge_value("B", "B", True, format_weight=0.5)
    1.5
    >>> rubric_arm_judge_value(None, "A", False, format_weight=0.5)
    0.0
  """
  return float(verdict == label) + float(format_weight) * float(bool(format_ok))


def rubric_arm_judge_reward(prompt: str, completion: str, *, label: str, format_weight: float = 0.5,
                            **_: Any) -> RewardResult:
  """The judge's reward for one judgement: `rubric_arm_judge_value` of the completion's verdict against
  the sample's ``label`` (``"A"`` or ``"B"``: where the preferred response was shown)."""
  del prompt
  if label not in ("A", "B"):
    raise ValueError(f"rubric_arm_judge_reward: label must be 'A' or 'B', got {label!r}")
  verdict, ok = parse_choice(completion), judge_format_ok(completion)
  reason = "correct" if verdict == label else ("no_verdict" if verdict is None else "wrong")
  return RewardResult(value=rubric_arm_judge_value(verdict, label, ok, format_weight=format_weight),
                      info={"reason": reason, "verdict": verdict, "format_ok": ok})


def rubric_arm_judge_prompts(rubric: str, question: str, chosen: str, rejected: str, *,
                             template: str = RUBRIC_ARM_JUDGE_TEMPLATE,
                             orders: Literal["both", "chosen_first"] = "both") -> tuple[list[str], list[str]]:
  """``(prompts, labels)``: the frozen judge's prompts for one rubric — ``(y_w, y_l)`` with label ``A``,
  then with ``orders="both"`` ``(y_l, y_w)`` with label ``B``."""
  if orders not in ("both", "chosen_first"):
    raise ValueError(f"orders: {orders!r} is not 'both' or 'chosen_first'")
  prompts, labels = [template.format(rubric=rubric, question=question, a=chosen, b=rejected)], ["A"]
  if orders == "both":
    prompts.append(template.format(rubric=rubric, question=question, a=rejected, b=chosen))
    labels.append("B")
  return prompts, labels


def rubric_arm_generator_reward(prompt: str, completion: str, *, question: str, chosen: str, rejected: str,
                                judge_fn: Callable[[Sequence[str]], Sequence[str]],
                                template: str = RUBRIC_ARM_JUDGE_TEMPLATE,
                                orders: Literal["both", "chosen_first"] = "both", **_: Any) -> RewardResult:
  """The rubric generator's reward: the frozen judge's correctness with the completion as its rubric.

  ``judge_fn(prompts) -> completions`` runs the frozen judge on judge prompts (``template`` formatted
  with the rubric, ``question`` and the pair); ``orders="both"`` judges ``(y_w, y_l)`` and ``(y_l, y_w)``
  and averages the two ``1(verdict = label)``; ``"chosen_first"`` judges only ``(y_w, y_l)``.
  """
  del prompt
  prompts, labels = rubric_arm_judge_prompts(completion, question, chosen, rejected, template=template, orders=orders)
  outs = list(judge_fn(prompts))
  if len(outs) != len(prompts):
    raise ValueError(f"judge_fn returned {len(outs)} completions for {len(prompts)} prompts")
  verdicts = [parse_choice(o) for o in outs]
  correct = [float(v == lab) for v, lab in zip(verdicts, labels)]
  value = sum(correct) / len(correct)
  reason = "no_verdict" if all(v is None for v in verdicts) else ("correct" if value == 1.0 else
                                                                   "wrong" if value == 0.0 else "split")
  return RewardResult(value=value, info={"reason": reason, "verdicts": verdicts, "correct": correct})
