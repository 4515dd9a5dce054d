"""The verifiable reward of the built-in arithmetic task (the quickstart's reward)."""

from __future__ import annotations

from typing import Any

from jaxrl import data as data_lib
from jaxrl import rewards as rewards_lib
from jaxrl.rewards import RewardResult


def arithmetic_reward(prompt: str, completion: str, *, answer: str | int, correct: float = 1.0,
                      incorrect: float = 0.0, **_: Any) -> RewardResult:
  """``correct`` if the integer after the last ``Answer:`` equals ``answer``, else ``incorrect``.

  Uses :func:`jaxrl.data.exact_match`; ``info["reason"]`` is ``correct``, ``wrong_answer`` or
  ``no_answer``. Load it as ``reward.fn: jaxrl.rl:arithmetic_reward``.

  Example:
    >>> arithmetic_reward("3+4=?", "3+4=7. Answer: 7", answer="7").value
    1.0
  """
  del prompt
  if data_lib.exact_match(completion, answer):
    return RewardResult(value=float(correct), info={"reason": "correct"})
  got = data_lib.extract_answer(completion)
  return RewardResult(value=float(incorrect), info={"reason": "no_answer" if got is None else "wrong_answer"})


def image_answer_reward(prompt: str, completion: str, *, answer: str | int, correct: float = 1.0,
                        incorrect: float = 0.0, **_: Any) -> RewardResult:
  """``correct`` if the word or integer after the last ``Answer:`` equals ``answer`` (case-insensitive), else
  ``incorrect``: the built-in image task's verifiable reward (:func:`jaxrl.data.image_answer_match`).

  ``info["reason"]`` is ``correct`` or ``wrong_answer``. Load it as ``reward.fn: jaxrl.rl:image_answer_reward``.

  Example:
    >>> image_answer_reward("How many circles?", "Answer: 3", answer="3").value
    1.0
  """
  del prompt
  ok = data_lib.image_answer_match(completion, answer)
  return RewardResult(value=float(correct if ok else incorrect), info={"reason": "correct" if ok else "wrong_answer"})


def weighted_reward(prompt: str, completion: str, *, components: dict[str, Any],
                    weights: dict[str, float] | None = None, **fields: Any) -> RewardResult:
  """``Σ_i w_i · r_i``: accuracy plus format rewards as in DeepSeek-R1, configurable from YAML.

  ``components`` maps names to reward import paths or built-in names; missing weights are 1
  (:func:`jaxrl.rewards.weighted_sum`). Example config::

      reward: {fn: "jaxrl.rl:weighted_reward",
               kwargs: {components: {accuracy: math, format: format}, weights: {format: 0.5}}}
  """
  return rewards_lib.weighted_sum(components, weights)(prompt, completion, **fields)
