"""Format rewards: ``<think>…</think>`` followed by an answer (DeepSeek-R1, DeepScaleR).

DeepSeek-R1-Zero rewards a completion for putting its reasoning between ``<think>`` and
``</think>`` and the answer after it (``<answer>…</answer>`` in R1's template); DeepScaleR gives 0
to a completion missing either delimiter (seeds 000 "Reward Function", 004 "DeepSeek-R1").

Chat templates of the R1-distilled models end the *prompt* with ``<think>\\n``, so the completion
holds only ``…</think> answer``; `FormatConfig.prompt_opens_think` (auto-detected by default)
accounts for that.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxrl.rewards._base import RewardResult, as_config

__all__ = ["FormatCheck", "FormatConfig", "check_format", "format_reward"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatConfig:
  """What a well-formatted completion looks like and what it earns."""

  open_tag: str = "<think>"
  """Opens the reasoning block."""
  close_tag: str = "</think>"
  """Closes the reasoning block; the answer follows it."""
  answer_pattern: str = r".+"
  """Regex the stripped text after `close_tag` must match in full (DOTALL); the default asks for a
  non-empty answer. `FormatConfig.r1` asks for ``<answer>…</answer>``."""
  single_block: bool = True
  """Exactly one `open_tag` and one `close_tag`."""
  prompt_opens_think: bool | None = None
  """The prompt already ends with `open_tag` (R1-distill chat templates); None detects it from the
  prompt. When True a completion may, but need not, repeat the tag."""
  pattern: str | None = None
  """A full-match regex (DOTALL) for the whole completion that replaces the tag rules above."""
  pass_value: float = 1.0
  """`format_reward` for a well-formatted completion."""
  fail_value: float = 0.0
  """`format_reward` otherwise."""

  def __post_init__(self):
    if not self.open_tag or not self.close_tag:
      raise ValueError(f"open_tag/close_tag must be non-empty, got {self.open_tag!r}/{self.close_tag!r}")
    for name in ("answer_pattern", "pattern"):
      value = getattr(self, name)
      if value is not None:
        try:
          re.compile(value)
        except re.error as e:
          raise ValueError(f"{name}: invalid regex {value!r}: {e}") from None

  @classmethod
  def r1(cls, **overrides: Any) -> FormatConfig:
    """DeepSeek-R1's template: ``<think> … </think> <answer> … </answer>``."""
    return cls(**{"answer_pattern": r"<answer>.+?</answer>", **overrides})


@dataclasses.dataclass(frozen=True)
class FormatCheck:
  """The outcome of `check_format`."""

  passed: bool
  reason: str
  """``ok``, ``missing_open_tag``, ``missing_close_tag``, ``multiple_think_blocks``,
  ``bad_answer`` (the text after the close tag does not match `answer_pattern`) or
  ``pattern_mismatch``."""
  thinking: str | None
  """The text between the tags (None when they are not found)."""
  answer: str
  """The text after the last close tag (the whole completion when there is none)."""


def check_format(prompt: str, completion: str, config: FormatConfig | None = None) -> FormatCheck:
  """Checks `completion` against `config` (see `FormatConfig`)."""
  cfg = config or FormatConfig()
  opens = cfg.prompt_opens_think
  if opens is None:
    opens = prompt.rstrip().endswith(cfg.open_tag)
  text = completion
  if opens and not completion.lstrip().startswith(cfg.open_tag):
    text = cfg.open_tag + completion
  close_at = text.rfind(cfg.close_tag)
  answer = text[close_at + len(cfg.close_tag):] if close_at >= 0 else completion
  if cfg.pattern is not None:
    ok = re.fullmatch(cfg.pattern, text, re.DOTALL) is not None
    return FormatCheck(ok, "ok" if ok else "pattern_mismatch", None, answer)
  body = text.lstrip()
  if not body.startswith(cfg.open_tag):
    return FormatCheck(False, "missing_open_tag", None, answer)
  if close_at < 0:
    return FormatCheck(False, "missing_close_tag", None, answer)
  if cfg.single_block and (text.count(cfg.open_tag) != 1 or text.count(cfg.close_tag) != 1):
    return FormatCheck(False, "multiple_think_blocks", None, answer)
  thinking = body[len(cfg.open_tag):body.rfind(cfg.close_tag)]
  if re.fullmatch(cfg.answer_pattern, answer.strip(), re.DOTALL) is None:
    return FormatCheck(False, "bad_answer", thinking, answer)
  return FormatCheck(True, "ok", thinking, answer)


def format_reward(prompt: str, completion: str, *, config: FormatConfig | dict | None = None, **_: Any) -> RewardResult:
  """`FormatConfig.pass_value` if `completion` is well formatted, else `fail_value`.

  ``info`` holds ``passed`` (bool, read by `gate`) and ``reason``.

  Example:
    >>> format_reward("Q", "<think>2+2=4</think> 4").value
    1.0
    >>> format_reward("Q", "4").info["reason"]
    'missing_open_tag'
  """
  cfg = as_config(FormatConfig, config, "config")
  check = check_format(prompt, completion, cfg)
  value = cfg.pass_value if check.passed else cfg.fail_value
  reason = "ok" if check.passed else f"format:{check.reason}"
  return RewardResult(value=value, info={"passed": check.passed, "reason": reason})
