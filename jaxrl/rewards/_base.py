"""The reward-function interface, result validation and loading by import path.

A reward function is any callable

    fn(prompt: str, completion: str, **sample_fields) -> float | RewardResult

`sample_fields` are the dataset's per-sample columns (``answer``, ``tests``, ``metadata`` ...);
a function takes the ones it needs by keyword and must accept (and ignore) the rest with
``**_``. Every built-in reward follows this rule.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from jaxrl.config import from_dict

__all__ = [
  "RewardFn",
  "RewardResult",
  "RewardValueError",
  "coerce_reward",
  "load_reward",
  "reward_name",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
  """A reward value with diagnostics.

  `info` travels with the sample into metrics and logs (e.g. ``{"reason": "wrong_answer"}``);
  it must be a plain dict of picklable values so it can cross a process pool.
  """

  value: float
  """The scalar reward; a finite real number."""
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  """Per-sample diagnostics (reason, extracted answer, per-test results ...)."""

  def __post_init__(self):
    if not isinstance(self.info, dict):
      raise TypeError(f"RewardResult.info must be a dict, got {type(self.info).__name__}")


class RewardFn(Protocol):
  """``fn(prompt, completion, **sample_fields) -> float | RewardResult``."""

  def __call__(self, prompt: str, completion: str, **sample_fields: Any) -> float | RewardResult: ...


class RewardValueError(ValueError):
  """A reward function returned something that is not a finite scalar.

  `reason` is a short machine-readable tag: ``wrong_type``, ``wrong_shape`` or ``non_finite``.
  """

  def __init__(self, reason: str, message: str):
    super().__init__(f"{reason}: {message}")
    self.reason = reason


def _scalar(value: Any) -> float:
  if isinstance(value, (bool, np.bool_)):
    raise RewardValueError("wrong_type", "got a bool; return a float (e.g. float(passed))")
  if isinstance(value, np.ndarray):
    if value.shape != ():
      raise RewardValueError("wrong_shape", f"got an array of shape {value.shape}; expected a scalar")
    value = value.item()
    if isinstance(value, bool):
      raise RewardValueError("wrong_type", "got a bool array; return a float")
  if not isinstance(value, numbers.Real):
    raise RewardValueError("wrong_type", f"got {type(value).__name__}; expected float or RewardResult")
  out = float(value)
  if not math.isfinite(out):
    raise RewardValueError("non_finite", f"got {out}")
  return out


def coerce_reward(out: Any) -> RewardResult:
  """Validates a reward function's return value and wraps it in a `RewardResult`.

  Accepts a real number (Python or NumPy scalar, or a 0-d array) or a `RewardResult` whose
  value is one. Bools are refused (a bare ``True`` usually means a forgotten reward scale).

  Raises:
    RewardValueError: wrong type, wrong shape, NaN or infinity.
  """
  if isinstance(out, RewardResult):
    return RewardResult(value=_scalar(out.value), info=out.info)
  return RewardResult(value=_scalar(out))


# Short names for the built-in rewards, usable wherever an import path is.
_BUILTIN = {
  "math": "jaxrl.rewards._math:math_reward",
  "code": "jaxrl.rewards._code:code_reward",
  "format": "jaxrl.rewards._format:format_reward",
  "reasoning_gym": "jaxrl.rewards._reasoning_gym:reasoning_gym_reward",
  "judge": "jaxrl.rewards._rubric:judge_reward",
  "pairwise_judge": "jaxrl.rewards._rubric:pairwise_judge_reward",
  "rubric": "jaxrl.rewards._rubric:rubric_reward",
  "rubric_anchor": "jaxrl.rewards._rubric:rubric_anchor_reward",
  "alignxplore_jud": "jaxrl.rewards._rubric:alignxplore_jud_reward",
  "alignxplore_gen": "jaxrl.rewards._rubric:alignxplore_gen_reward",
  "hard_format": "jaxrl.rewards._vision_r1:hard_format_reward",
  "caprl": "jaxrl.rewards._caprl:caprl_reward",
  "rubicap": "jaxrl.rewards._rubicap:rubicap_reward",
}


def _import_module(name: str):
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    # `jaxrl.rewards.math` names the public face of the private `jaxrl.rewards._math`.
    head, _, tail = name.rpartition(".")
    if head == "jaxrl.rewards" and not tail.startswith("_") and e.name == name:
      return importlib.import_module(f"{head}._{tail}")
    raise


def _resolve(spec: str) -> Callable[..., Any]:
  target = _BUILTIN.get(spec, spec)
  module_name, sep, attr = target.partition(":")
  if not sep or not module_name or not attr:
    raise ValueError(
      f"reward {spec!r}: expected 'package.module:function' or one of {sorted(_BUILTIN)}"
    )
  try:
    obj: Any = _import_module(module_name)
  except ImportError as e:
    raise ImportError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
  for part in attr.split("."):
    try:
      obj = getattr(obj, part)
    except AttributeError:
      raise AttributeError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
  if not callable(obj):
    raise TypeError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
  return obj


def load_reward(spec: str | Callable[..., Any], /, **kwargs: Any) -> Callable[..., Any]:
  """Returns the reward function named by `spec`, with `kwargs` bound.

  Args:
    spec: ``"module:function"`` (any importable module, e.g. a user's
      ``"my_pkg.rewards:length_penalty"``; ``"jaxrl.rewards.math:math_reward"`` resolves to the
      private ``jaxrl.rewards._math``), a short built-in name (``"math"``, ``"code"``,
      ``"format"``, ``"reasoning_gym"``, and the judge rewards ``"judge"``, ``"pairwise_judge"``,
      ``"rubric"``, ``"rubric_anchor"``, ``"alignxplore_jud"``, ``"alignxplore_gen"``; the vision-language
      rewards ``"hard_format"``, ``"caprl"``, ``"rubicap"``) or a callable.
    **kwargs: bound with `functools.partial`, e.g. ``config=MathRewardConfig.areal()`` or, from
      YAML, ``config={"correct_value": 5.0}``.

  Example:
    >>> fn = load_reward("jaxrl.rewards.math:math_reward")
    >>> fn("1+1?", "<think>easy</think> \\\\boxed{2}", answer="2").value
    1.0
  """
  fn = spec if callable(spec) else _resolve(spec)
  return functools.partial(fn, **kwargs) if kwargs else fn


def reward_name(fn: Any) -> str:
  """A readable name for error messages: the import path of `fn` (through partials)."""
  if isinstance(fn, str):
    return fn
  base = fn
  while isinstance(base, functools.partial):
    base = base.func
  module = getattr(base, "__module__", None)
  qual = getattr(base, "__qualname__", None) or type(base).__qualname__
  return f"{module}:{qual}" if module else qual


def as_config(cls: type, value: Any, field: str):
  """`value` as an instance of the config dataclass `cls` (None → defaults, dict → fields)."""
  if value is None:
    return cls()
  if isinstance(value, cls):
    return value
  if isinstance(value, Mapping):
    return from_dict(cls, dict(value), prefix=field)
  raise TypeError(f"{field}: expected {cls.__name__}, dict or None, got {type(value).__name__}")
