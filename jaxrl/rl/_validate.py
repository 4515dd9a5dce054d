"""Load-time checks of the RL config's function choices against what the trainer can supply.

The RL trainer calls ``ADVANTAGES[name](rewards=, group_ids=, response_mask=, num_groups=,
**advantage_kwargs)`` on each step's batch and ``OBJECTIVES[name](logprobs=, old_logprobs=,
advantages=, loss_weights=, response_mask=, segment_ids=, entropy=, [prox_logprobs=],
**objective_kwargs)`` in every micro-batch; with a ``critic:`` section the critic supplies the values
(and dense rewards) of ``gae``/``egae``. An estimator that needs any other per-sample input
(greedy-baseline rewards, semantic clusters, tree prefixes without an ``env:`` section; critic
values without a ``critic:``) cannot run from a config, so it is rejected when the config loads,
with the inputs it needs; so are unknown or mistyped keyword arguments, and reward ``kwargs`` that
the reward function does not take.
"""

from __future__ import annotations

import inspect
from typing import Any, get_args, get_type_hints

import jax

from jaxrl import config as config_lib
from jaxrl import losses, rewards

ADVANTAGE_INPUTS = frozenset({"rewards", "group_ids", "response_mask"})
"""Per-sample inputs the trainer passes to every advantage estimator (``num_groups`` too, unless set)."""

TREE_INPUTS = frozenset({"prefix_ids"})
"""Supplied by tree (ARPO) rollouts of the agentic trainer (``jaxrl.envs``, an ``env:`` section)."""

OBJECTIVE_INPUTS = frozenset({"logprobs", "old_logprobs", "advantages", "loss_weights", "response_mask",
                              "segment_ids", "entropy", "prox_logprobs"})
"""Inputs the trainer passes to a policy objective (``prox_logprobs`` for ``decoupled_ppo`` only)."""

CRITIC_ESTIMATORS = frozenset({"gae", "egae"})
"""Estimators that need a value model: runnable with a ``critic:`` section (jaxrl/rl/_critic.py)."""

CRITIC_INPUTS = frozenset({"values", "token_rewards", "finished", "bootstrap_values"})
"""Inputs of the critic estimators that the critic supplies (``jaxrl.rl._critic.gae_advantages``)."""

_ONE_OF = {"seed_grpo": ("semantic_entropy", "cluster_ids")}
"""Estimators whose per-sample input is one of several optional arrays (the signature cannot say)."""


def _is_array(tp: Any) -> bool:
  return tp is jax.Array or any(_is_array(a) for a in get_args(tp))


def _required(fn) -> list[str]:
  return [n for n, p in inspect.signature(fn).parameters.items()
          if p.kind is p.KEYWORD_ONLY and p.default is p.empty]


def advantage_needs(name: str, *, critic: bool = False, tree: bool = False) -> str | None:
  """What estimator ``name`` needs beyond the trainer's inputs (with a ``critic:`` section if
  ``critic``), or None if a config can run it."""
  fn = losses.ADVANTAGES[name]
  if name in CRITIC_ESTIMATORS:
    if critic:
      return None
    return ("a value model for its per-token values: add a `critic:` section (docs/rl.md, PPO with a critic), "
            "or use a critic-free estimator (grpo, rloo, reinforce_pp, ...)")
  hints = get_type_hints(fn)
  supplied = ADVANTAGE_INPUTS | (TREE_INPUTS if tree else frozenset())
  missing = [n for n in _required(fn) if n not in supplied and _is_array(hints.get(n))]
  if name in _ONE_OF:
    missing.append(" or ".join(_ONE_OF[name]))
  if not missing:
    return None
  return f"per-sample inputs the RL trainer does not supply: {', '.join(missing)}"


def check_advantage(name: str, kwargs: dict[str, Any], *, critic: bool = False, tree: bool = False) -> None:
  """Raises ``ConfigError`` naming the key if ``algorithm.advantage``/``advantage_kwargs`` cannot run
  (``critic``: a ``critic:`` section supplies the values of ``gae``/``egae``)."""
  needs = advantage_needs(name, critic=critic, tree=tree)
  if needs is not None:
    raise config_lib.ConfigError(f"algorithm.advantage: {name!r} needs {needs}")
  fn = losses.ADVANTAGES[name]
  hints = get_type_hints(fn)
  arrays = {n for n in inspect.signature(fn).parameters if _is_array(hints.get(n))}
  supplied = ADVANTAGE_INPUTS | (CRITIC_INPUTS if name in CRITIC_ESTIMATORS else frozenset()) | (
      TREE_INPUTS if tree else frozenset())
  config_lib.check_kwargs(fn, kwargs, key="algorithm.advantage_kwargs", what=f"advantage {name!r}",
                          reserved=supplied | arrays | {"axis_name", "global_moments"})
  for n in _required(fn):
    if n not in supplied and n not in kwargs:
      raise config_lib.ConfigError(f"algorithm.advantage_kwargs.{n} is required by advantage {name!r}")


def check_critic(advantage: str, kwargs: dict[str, Any], has_critic: bool) -> None:
  """Raises ``ConfigError`` if ``algorithm.advantage`` needs a ``critic:`` section that is missing, or
  if a ``critic:`` section is given to an estimator that does not use values."""
  if advantage in CRITIC_ESTIMATORS and not has_critic:
    check_advantage(advantage, kwargs, critic=False)
  if has_critic and advantage not in CRITIC_ESTIMATORS:
    raise config_lib.ConfigError(f"critic: set, but algorithm.advantage {advantage!r} does not use values; "
                                 f"use one of {sorted(CRITIC_ESTIMATORS)} or remove the critic section")


def check_objective(name: str, kwargs: dict[str, Any]) -> None:
  """Raises ``ConfigError`` naming the key if ``algorithm.objective``/``objective_kwargs`` cannot run."""
  fn = losses.OBJECTIVES[name]
  config_lib.check_kwargs(fn, kwargs, key="algorithm.objective_kwargs", what=f"objective {name!r}",
                          reserved=OBJECTIVE_INPUTS | losses.CONTEXT_KEYS, extra_ok=False)
  for n in _required(fn):
    if n not in OBJECTIVE_INPUTS and n not in kwargs:
      raise config_lib.ConfigError(f"algorithm.objective_kwargs.{n} is required by objective {name!r}")


def check_reward(fn_spec: str, kwargs: dict[str, Any]) -> None:
  """Raises ``ConfigError`` if ``reward.fn`` cannot be imported or ``reward.kwargs`` does not fit it."""
  try:
    fn = rewards.load_reward(fn_spec)
  except (ImportError, AttributeError, TypeError, ValueError) as e:
    raise config_lib.ConfigError(f"reward.fn: {e}") from e
  if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
    return  # a callable object: its __call__ signature is the user's business
  positional = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
  config_lib.check_kwargs(fn, kwargs, key="reward.kwargs", what=f"reward {fn_spec!r}",
                          reserved=frozenset(positional[:2]))
