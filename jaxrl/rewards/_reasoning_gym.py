"""Procedural reasoning tasks from the ``reasoning-gym`` package (offline) and their verifiers.

`reasoning_gym_dataset` draws prompts from one of reasoning-gym's generators (``chain_sum``,
``basic_arithmetic``, ``leg_counting`` …, see ``reasoning_gym.factory.DATASETS``);
`reasoning_gym_reward` scores a completion with that dataset's own ``score_answer``, which may
give partial credit in [0, 1].

reasoning-gym is an optional dependency; without it both functions raise an ImportError that
names the package.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jaxrl import _extras
from jaxrl.rewards._base import RewardResult, as_config
from jaxrl.rewards._format import FormatConfig, check_format
from jaxrl.rewards._math import extract_boxed

__all__ = ["ReasoningGymRewardConfig", "reasoning_gym_dataset", "reasoning_gym_reward"]

_PACKAGE = "reasoning-gym"


def _rg():
  try:
    reasoning_gym = _extras.require("reasoning_gym")
  except ImportError as e:
    raise ImportError(
      f"jaxrl.rewards reasoning-gym tasks need the {_PACKAGE!r} package (pip install {_PACKAGE})"
    ) from e
  return reasoning_gym


def reasoning_gym_dataset(
  name: str, size: int, seed: int, *, system_prompt: str = "default", **dataset_kwargs: Any
) -> list[dict[str, Any]]:
  """`size` records of reasoning-gym's `name` generator, deterministic in `seed`.

  Args:
    name: a registered reasoning-gym dataset (e.g. ``"chain_sum"``).
    size: number of records.
    seed: generator seed.
    system_prompt: a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (they ask for
      ``<answer>…</answer>``), or ``""`` for none.
    **dataset_kwargs: the dataset's config fields (e.g. ``num_terms=3``).

  Returns:
    Records ``{"prompt", "system", "answer", "metadata", "dataset"}``; ``answer`` and
    ``metadata`` are the sample fields `reasoning_gym_reward` needs.
  """
  rg = _rg()
  from reasoning_gym.utils import SYSTEM_PROMPTS

  if system_prompt and system_prompt not in SYSTEM_PROMPTS:
    raise ValueError(f"system_prompt must be one of {sorted(SYSTEM_PROMPTS)} or '', got {system_prompt!r}")
  ds = rg.create_dataset(name, size=size, seed=seed, **dataset_kwargs)
  system = SYSTEM_PROMPTS[system_prompt] if system_prompt else ""
  return [
    {"prompt": e["question"], "system": system, "answer": e["answer"], "metadata": e["metadata"], "dataset": name}
    for e in (ds[i] for i in range(size))
  ]


@functools.lru_cache(maxsize=64)
def _scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
  return _rg().get_score_answer_fn(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymRewardConfig:
  """Answer extraction and format rules of `reasoning_gym_reward`."""

  answer_tag: str = "answer"
  """The answer is the content of the last ``<answer_tag>…</answer_tag>``."""
  boxed_fallback: bool = True
  """Without the tag, fall back to the last ``\\boxed{…}``."""
  require_think: bool = False
  """Also require the ``<think>…</think>`` format (`think`)."""
  think: FormatConfig = dataclasses.field(default_factory=FormatConfig)
  """The format check used when `require_think` is on."""
  format_error_value: float = 0.0
  """Reward when `require_think` is on and the format is broken."""

  def __post_init__(self):
    if not self.answer_tag.isidentifier():
      raise ValueError(f"answer_tag must be a plain tag name, got {self.answer_tag!r}")


def reasoning_gym_reward(
  prompt: str,
  completion: str,
  *,
  answer: str,
  metadata: dict[str, Any],
  config: ReasoningGymRewardConfig | dict | None = None,
  **_: Any,
) -> RewardResult:
  """The reasoning-gym dataset's ``score_answer`` of the completion's answer.

  Args:
    prompt: the question (used only to detect a prompt-opened ``<think>``).
    completion: model output with ``<answer>…</answer>``.
    answer: the record's reference answer.
    metadata: the record's metadata (its ``source_dataset`` picks the scorer).
    config: extraction rules.

  Returns:
    ``RewardResult`` in [0, 1], ``info["reason"]`` ``scored`` / ``no_answer`` / ``format:<why>``.
  """
  cfg = as_config(ReasoningGymRewardConfig, config, "config")
  _rg()
  from reasoning_gym.utils import extract_answer

  region = completion
  if cfg.require_think:
    fmt = check_format(prompt, completion, cfg.think)
    if not fmt.passed:
      return RewardResult(value=cfg.format_error_value, info={"reason": f"format:{fmt.reason}"})
    region = fmt.answer
  got = extract_answer(region, tag_name=cfg.answer_tag)
  if got is None and cfg.boxed_fallback:
    got = extract_boxed(region)
  if got is None:
    return RewardResult(value=0.0, info={"reason": "no_answer"})
  name = metadata["source_dataset"]
  score = float(_scorer(name)(got, {"question": prompt, "answer": answer, "metadata": metadata}))
  return RewardResult(value=score, info={"reason": "scored", "extracted": got[:200], "dataset": name})
