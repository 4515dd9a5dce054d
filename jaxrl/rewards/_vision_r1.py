"""Vision-R1's hard formatting result reward (HFRRF; shared/seeds/004, Vision-R1 "奖励函数").

The reward is 1 only when the output format is valid *and* the final answer is correct, else 0: a long
reasoning with a wrong answer earns nothing, and so does a right answer outside the format. Valid format:
one ``<think>…</think>`` block at the start with non-empty reasoning, then a non-empty answer (the text after
``</think>``; with ``FormatConfig.r1`` it must be ``<answer>…</answer>``). Correctness is the math reward's
check (`extract_answer` then `is_equivalent`, math-verify when installed) on the answer only (inside
``<answer>…</answer>`` when present: all of it, or its ``\boxed{}``), so a number that appears in the
reasoning but not in the answer does not count.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxrl.rewards._base import RewardResult, as_config
from jaxrl.rewards._format import FormatConfig, check_format
from jaxrl.rewards._math import Backend, MathRewardConfig, math_reward

__all__ = ["HardFormatConfig", "hard_format_reward"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardFormatConfig:
  """The two halves of the hard rule and the values it gives."""

  think: FormatConfig = dataclasses.field(default_factory=FormatConfig)
  """The format half: ``<think>…</think>`` then the answer (`FormatConfig.r1`: ``<answer>…</answer>``)."""
  require_nonempty_think: bool = True
  """Blank reasoning (``<think> </think>``) fails the format half."""
  extract: tuple[str, ...] = ("boxed", "answer_line", "last_number")
  """How the answer is read from the text after ``</think>`` (inside ``<answer>`` when present)."""
  backend: Backend = "auto"
  """Equivalence backend of the result half (`is_equivalent`)."""
  correct_value: float = 1.0
  fail_value: float = 0.0


def hard_format_reward(prompt: str, completion: str, *, answer: Any,
                       config: HardFormatConfig | dict | None = None, **_: Any) -> RewardResult:
  """``1[format valid] · 1[answer correct]`` (as `correct_value` / `fail_value`).

  ``info``: ``format_ok``, ``answer_ok`` (None when the format already failed), ``reason`` (``correct``,
  ``format:<why>`` or the math reward's ``wrong_answer`` / ``no_answer`` / ``answer_too_long``) and
  ``extracted``.

  Example:
    >>> hard_format_reward("Q", "<think>3+4</think> \\\\boxed{7}", answer="7").value
    1.0
    >>> hard_format_reward("Q", "\\\\boxed{7}", answer="7").info["reason"]
    'format:missing_open_tag'
  """
  cfg = as_config(HardFormatConfig, config, "config")
  fmt = check_format(prompt, completion, cfg.think)
  reason = None if fmt.passed else f"format:{fmt.reason}"
  if reason is None and cfg.require_nonempty_think and not (fmt.thinking or "").strip():
    reason = "format:empty_think"
  if reason is not None:
    return RewardResult(value=cfg.fail_value, info={"format_ok": False, "answer_ok": None, "reason": reason})
  region = fmt.answer
  tagged = _ANSWER_TAG.findall(region)
  if tagged:  # the whole tag content is the answer unless it boxes one
    region = tagged[-1] if "\\boxed" in tagged[-1] else "\\boxed{" + tagged[-1].strip() + "}"
  math_cfg = MathRewardConfig(require_think=False, answer_after_think=False, extract=cfg.extract, backend=cfg.backend)
  res = math_reward(prompt, region, answer=answer, config=math_cfg)
  ok = res.info["reason"] == "correct"
  info = {"format_ok": True, "answer_ok": ok, "reason": res.info["reason"], "extracted": res.info.get("extracted")}
  return RewardResult(value=cfg.correct_value if ok else cfg.fail_value, info=info)
