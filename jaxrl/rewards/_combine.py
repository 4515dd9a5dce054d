"""Combining rewards: weighted sums, gating, and ARPO's hierarchical tool-use reward.

Each combinator is a small frozen dataclass that is itself a reward function, so it pickles into
process workers when its parts are import paths or module-level functions.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.rewards._base import RewardResult, coerce_reward, load_reward

__all__ = ["Gate", "Hierarchical", "WeightedSum", "gate", "hierarchical_reward", "weighted_sum"]

Component = str | Callable[..., Any]


def _call(component: Component, prompt: str, completion: str, fields: Mapping[str, Any]) -> RewardResult:
  return coerce_reward(load_reward(component)(prompt, completion, **fields))


@dataclasses.dataclass(frozen=True)
class WeightedSum:
  """``R = Σ_i w_i · r_i(prompt, completion)``; ``info["components"]`` holds each ``r_i``."""

  components: Mapping[str, Component]
  weights: Mapping[str, float]

  def __post_init__(self):
    if not self.components:
      raise ValueError("components: need at least one reward")
    unknown = sorted(set(self.weights) - set(self.components))
    if unknown:
      raise ValueError(f"weights: {unknown} name no component (components: {sorted(self.components)})")

  def __call__(self, prompt: str, completion: str, **fields: Any) -> RewardResult:
    values, infos, total = {}, {}, 0.0
    for name, component in self.components.items():
      r = _call(component, prompt, completion, fields)
      values[name], infos[name] = r.value, r.info
      total += float(self.weights.get(name, 1.0)) * r.value
    return RewardResult(value=total, info={"components": values, "component_info": infos})


def weighted_sum(components: Mapping[str, Component], weights: Mapping[str, float] | None = None) -> WeightedSum:
  """A reward that is the weighted sum of `components` (missing weights are 1).

  Example:
    >>> fn = weighted_sum({"format": "format", "math": "math"}, {"format": 0.1})
  """
  return WeightedSum(dict(components), dict(weights or {}))


def _passed(result: RewardResult, threshold: float) -> bool:
  flag = result.info.get("passed")
  return flag if isinstance(flag, bool) else result.value >= threshold


@dataclasses.dataclass(frozen=True)
class Gate:
  """``R = reward(...)`` if ``check(...)`` passes, else `fail_value` (`reward` is not called).

  "Passes" reads ``info["passed"]`` when the check provides it (as `format_reward` does) and
  otherwise means ``value >= threshold``.
  """

  check: Component
  reward: Component
  fail_value: float = 0.0
  threshold: float = 0.5

  def __call__(self, prompt: str, completion: str, **fields: Any) -> RewardResult:
    g = _call(self.check, prompt, completion, fields)
    if not _passed(g, self.threshold):
      return RewardResult(value=self.fail_value, info={"gate": False, "reason": g.info.get("reason", "gate_failed")})
    r = _call(self.reward, prompt, completion, fields)
    return RewardResult(value=r.value, info={**r.info, "gate": True})


def gate(check: Component, reward: Component, *, fail_value: float = 0.0, threshold: float = 0.5) -> Gate:
  """``gate(format, correctness)``: correctness only when the format check passes.

  Example:
    >>> fn = gate("format", "math")
    >>> fn("Q", "\\\\boxed{4}", answer="4").value  # right answer, no <think> block
    0.0
  """
  return Gate(check, reward, fail_value, threshold)


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """ARPO's hierarchical reward (after Tool-Star); seed 000, "Hierarchical Reward Design".

  .. math::
    R = \\begin{cases} \\max(\\mathrm{Acc} + r_M, \\mathrm{Acc}) & \\text{format good and Acc} > 0 \\\\
        0 & \\text{format good and Acc} = 0 \\\\ -1 & \\text{otherwise} \\end{cases}

  with the multi-tool bonus :math:`r_M` = `multi_tool_bonus` when at least `min_tools` of the
  `tools` (name → regex of its call) occur in the completion, else 0. Acc is expected in [0, 1]
  (exact match or F1); an Acc ≤ 0 takes the middle branch.
  """

  format: Component
  accuracy: Component
  tools: Mapping[str, str]
  multi_tool_bonus: float = 0.1
  min_tools: int = 2
  format_fail_value: float = -1.0

  def __post_init__(self):
    for name, pattern in self.tools.items():
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"tools[{name!r}]: invalid regex {pattern!r}: {e}") from None
    if self.min_tools < 1:
      raise ValueError(f"min_tools must be >= 1, got {self.min_tools!r}")

  def __call__(self, prompt: str, completion: str, **fields: Any) -> RewardResult:
    f = _call(self.format, prompt, completion, fields)
    if not _passed(f, 0.5):
      info = {"reason": f.info.get("reason", "format"), "format": False}
      return RewardResult(value=self.format_fail_value, info=info)
    acc = _call(self.accuracy, prompt, completion, fields)
    used = sorted(name for name, pattern in self.tools.items() if re.search(pattern, completion))
    bonus = self.multi_tool_bonus if len(used) >= self.min_tools else 0.0
    value = max(acc.value + bonus, acc.value) if acc.value > 0 else 0.0
    info = {**acc.info, "format": True, "accuracy": acc.value, "tools_used": used,
            "tool_bonus": bonus if acc.value > 0 else 0.0}
    return RewardResult(value=value, info=info)


def hierarchical_reward(
  format: Component,  # noqa: A002 (the paper's name for the term)
  accuracy: Component,
  *,
  tools: Mapping[str, str] | None = None,
  multi_tool_bonus: float = 0.1,
  min_tools: int = 2,
  format_fail_value: float = -1.0,
) -> Hierarchical:
  """ARPO / Tool-Star hierarchical reward; `tools` defaults to ``<search>`` and ``<python>`` calls."""
  tools = dict(tools) if tools is not None else {"search": r"<search>", "python": r"<python>"}
  return Hierarchical(format, accuracy, tools, multi_tool_bonus, min_tools, format_fail_value)
