"""The environment interface and registry.

An environment is one episode: ``reset(record) -> messages`` gives the conversation the policy
starts from; ``step(assistant_turn) -> StepResult(observation, reward, done, info)`` consumes one
assistant turn (its decoded text) and returns the messages to append before the next turn (tool
results, user feedback) or ``None`` with ``done=True``. Rewards of all steps are summed. A new
environment is one small file::

    from jaxrl import envs

    @envs.register_env("echo")
    class Echo(envs.Env):
      def reset(self, record):
        self.answer = record["answer"]
        return [{"role": "user", "content": record["prompt"]}]

      def step(self, turn):
        return envs.StepResult(None, float(turn.strip() == self.answer), True, {})

Single-turn verifiable tasks are :class:`SingleTurnEnv` (``"single_turn"``), so every RL run can go
through the same multi-turn driver. ARPO branching copies an episode with :meth:`Env.fork`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple
from jaxrl.rewards import load_reward
from jaxrl.rewards import coerce_reward

ENVS: dict[str, type] = {}
"""Environment classes by name (:func:`register_env`)."""


class StepResult(NamedTuple):
  """What :meth:`Env.step` returns; unpacks as ``observation, reward, done, info``."""

  observation: list[dict[str, Any]] | None
  reward: float
  done: bool
  info: dict[str, Any]


class Env:
  """Base class of environments (one instance = one episode).

  Subclasses implement :meth:`reset` and :meth:`step`; :meth:`metrics` reports per-episode numbers
  (tool calls, errors) that the rollout driver averages.
  """

  def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    raise NotImplementedError

  def step(self, turn: str) -> StepResult:
    raise NotImplementedError

  def metrics(self) -> dict[str, float]:
    """Per-episode numbers to average over a rollout (default none)."""
    return {}

  def fork(self) -> Env:
    """An independent copy of this episode's state (ARPO branches continue from it).

    Default: a shallow copy whose list / dict / set attributes are copied one level deep; shared
    resources (tool executors, indexes) stay shared. Override for deeper state.
    """
    new = copy.copy(self)
    for k, v in vars(self).items():
      if isinstance(v, (list, dict, set)):
        setattr(new, k, copy.copy(v))
    return new


def register_env(name: str):
  """Class decorator adding an :class:`Env` subclass to :data:`ENVS` under ``name``."""
  def deco(cls):
    if name in ENVS and ENVS[name] is not cls:
      raise ValueError(f"environment {name!r} is already registered")
    ENVS[name] = cls
    return cls
  return deco


def env_factory(name: str, *, runner=None, **kwargs: Any) -> Callable[[], Env]:
  """A zero-argument constructor of fresh episodes of environment ``name`` with ``kwargs``.

  A class with a ``build_factory(**kwargs)`` classmethod builds its shared resources once there
  (the tool environment's thread pool and search index); otherwise ``cls(**kwargs)`` per episode.
  ``runner`` (the trainer's :class:`jaxrl.rewards.RewardRunner`) goes to a ``build_factory`` that takes
  a ``runner`` argument (the tool environment runs its tool calls in that pool).
  """
  if name not in ENVS:
    raise ValueError(f"env.name: unknown environment {name!r}; registered: {sorted(ENVS)}")
  cls = ENVS[name]
  if hasattr(cls, "build_factory"):
    import inspect
    if runner is not None and "runner" in inspect.signature(cls.build_factory).parameters:
      kwargs = dict(kwargs, runner=runner)
    return cls.build_factory(**kwargs)
  cls(**kwargs)  # fail now, naming the bad keyword, not inside the rollout
  return lambda: cls(**kwargs)


def prompt_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
  """The messages a record's prompt consists of (as :func:`jaxrl.data.encode_prompt` reads them)."""
  from jaxrl.data import DataError  # lazy: jaxrl.data pulls in JAX; reward-pool workers import envs without it
  from jaxrl.data import record_messages  # lazy: jaxrl.data pulls in JAX; reward-pool workers import envs without it
  if "messages" in record:
    messages = record_messages(record)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [dict(m) for m in (messages[:assistant[-1]] if assistant else messages)]
  if isinstance(record.get("prompt"), str):
    return [{"role": "user", "content": record["prompt"]}]
  if isinstance(record.get("prompt"), list):
    return [dict(m) for m in record["prompt"]]
  raise DataError(f"record needs 'messages' or 'prompt'; has keys {sorted(record)}")


def _last_user(messages: list[dict[str, Any]]) -> str:
  users = [m.get("content", "") for m in messages if m.get("role") == "user"]
  return users[-1] if users else ""


@register_env("single_turn")
class SingleTurnEnv(Env):
  """One assistant turn scored by a reward function: the ordinary verifiable-reward task.

  Args:
    reward_fn: import path or built-in name of a reward (:func:`jaxrl.rewards.load_reward`).
    reward_kwargs: bound to the reward function.
  """

  def __init__(self, *, reward_fn: str = "jaxrl.rl:arithmetic_reward", reward_kwargs: dict[str, Any] | None = None):
    self.reward_fn = reward_fn
    self._fn = load_reward(reward_fn, **dict(reward_kwargs or {}))

  def reset(self, record):
    from jaxrl.rl import reward_fields  # lazy: jaxrl.rl pulls in JAX; reward-pool workers import envs without it
    self.fields = reward_fields(record)
    self.messages = prompt_messages(record)
    return list(self.messages)

  def step(self, turn):
    res = coerce_reward(self._fn(_last_user(self.messages), turn, **self.fields))
    return StepResult(None, float(res.value), True, dict(res.info))
