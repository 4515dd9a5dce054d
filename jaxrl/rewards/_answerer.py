"""One way to ask a chat model for text: a judge config (`Judge.chat` over any OpenAI-compatible server or
`jaxrl serve`, cached and retried) or an in-process callable, behind the same signature.

The vision-language rewards and data builders (CapRL's answerer, RubiCap's rubric writer and judge, Vision-R1's
bridging models) take their model as ``spec``: a dict or `JudgeConfig` (YAML), a `Judge`, an import path
``"module:function"`` or a callable ``fn(messages, *, max_tokens, temperature, seed) -> str``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl.rewards._base import load_reward
from jaxrl.rewards._judge import Judge, JudgeConfig, get_judge

__all__ = ["ChatFn", "as_chat"]

ChatFn = Callable[..., str]
"""``fn(messages, *, max_tokens: int | None, temperature: float | None, seed: int | None) -> str``."""


def as_chat(spec: Any) -> ChatFn:
  """`spec` as a `ChatFn`: a judge config (dict, `JudgeConfig`, `Judge`, None for the environment's judge)
  answers through `Judge.chat`; an import path or a callable is called as is."""
  if spec is None or isinstance(spec, (Mapping, JudgeConfig, Judge)):
    judge = get_judge(spec)

    def chat(messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None = None,
             temperature: float | None = None, seed: int | None = None) -> str:
      return judge.chat(messages, max_tokens=max_tokens, temperature=temperature, seed=seed).text

    return chat
  if isinstance(spec, str):
    return load_reward(spec)
  if callable(spec):
    return spec
  raise TypeError(f"expected a judge config (dict), a Judge, an import path or a callable, got {type(spec).__name__}")
