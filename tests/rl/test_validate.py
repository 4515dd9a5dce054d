"""Load-time validation: every registry entry either runs from a config or is rejected when it loads."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl import losses, rl
from jaxrl.rl import _validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REQUIRED_OPTIONS = {"grpo_passk": {"k": 2}}


def _load(*overrides):
  return config_lib.load(rl.RLConfig, CONFIGS / "grpo_tiny.yaml", list(overrides))


def _rollout():
  rewards = np.array([1, 0, 0, 0, 1, 1, 0, 1], np.float32)
  return rl.Rollout(
      prompt_ids=tuple(np.arange(1, 4, dtype=np.int32) for _ in range(8)), tokens=np.ones((8, 5), np.int32),
      logprobs=np.zeros((8, 5), np.float32), lengths=np.array([5, 3, 4, 5, 2, 5, 1, 4], np.int32),
      truncated=np.zeros(8, bool), group_ids=np.repeat(np.arange(2, dtype=np.int32), 4), rewards=rewards,
      task_rewards=rewards, texts=tuple("x" * 8))


@pytest.mark.parametrize("name", sorted(losses.ADVANTAGES))
def test_every_advantage_runs_from_a_config_or_is_rejected_at_load(name):
  options = REQUIRED_OPTIONS.get(name, {})
  needs = _validate.advantage_needs(name)
  if needs is not None:
    with pytest.raises(config_lib.ConfigError, match=rf"algorithm\.advantage: '{name}' needs"):
      _load(f"algorithm.advantage={name}", f"algorithm.advantage_kwargs={options}")
    return
  cfg = _load(f"algorithm.advantage={name}", f"algorithm.advantage_kwargs={options}")
  ro = _rollout()
  adv, metrics = rl.compute_advantages(ro, name=cfg.algorithm.advantage, options=cfg.algorithm.advantage_kwargs)
  assert adv.shape == ro.tokens.shape and np.isfinite(adv).all() and np.abs(adv).sum() > 0
  assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name, inputs", [
    ("gae", "value model"), ("egae", "value model"), ("remax", "baseline_rewards"),
    ("seed_grpo", "semantic_entropy or cluster_ids"), ("arpo_hard", "prefix_ids")])
def test_estimators_needing_unsupplied_inputs_say_what_they_need(name, inputs):
  with pytest.raises(config_lib.ConfigError, match=inputs):
    _load(f"algorithm.advantage={name}")


@pytest.mark.parametrize("name", sorted(losses.OBJECTIVES))
def test_every_objective_runs_with_the_trainer_inputs(name):
  cfg = _load(f"algorithm.objective={name}")
  rng = np.random.default_rng(0)
  lp = jnp.asarray(rng.normal(size=(4, 6)) - 2.0, jnp.float32)
  mask = jnp.asarray(rng.integers(0, 2, size=(4, 6)), jnp.float32).at[:, 0].set(1.0)
  inputs = dict(logprobs=lp, old_logprobs=lp + 0.1, advantages=jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
                loss_weights=mask / mask.sum(), response_mask=mask, segment_ids=jnp.ones((4, 6), jnp.int32),
                entropy=jnp.ones((4, 6)))
  if cfg.algorithm.decoupled:
    inputs["prox_logprobs"] = lp + 0.05
  loss, metrics = losses.OBJECTIVES[name](**inputs, **cfg.algorithm.objective_kwargs)
  assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(v)).all() for v in metrics.values())


@pytest.mark.parametrize("override, message", [
    ("algorithm.advantage_kwargs={std_normalise: false}",
     "unknown config key 'algorithm.advantage_kwargs.std_normalise'"),
    ("algorithm.advantage_kwargs={eps: small}", "algorithm.advantage_kwargs.eps: expected a float"),
    ("algorithm.advantage_kwargs={rewards: 1}", "algorithm.advantage_kwargs.rewards: 'rewards' is an input"),
    ("algorithm.advantage=grpo_passk", "algorithm.advantage_kwargs.k is required by advantage 'grpo_passk'"),
    ("algorithm.objective_kwargs={epsilon: 0.2, epsilon_hgh: 0.3}",
     "unknown config key 'algorithm.objective_kwargs.epsilon_hgh'"),
    ("algorithm.objective_kwargs={epsilon: '0.2'}", "algorithm.objective_kwargs.epsilon: expected a float"),
    ("reward.kwargs={corect: 2.0}", "unknown config key 'reward.kwargs.corect'"),
    ("reward.kwargs={correct: yes}", "reward.kwargs.correct: expected a float"),
    ("reward.fn=no_such_module:fn", "reward.fn: reward 'no_such_module:fn': cannot import"),
])
def test_misspelt_or_mistyped_kwargs_fail_at_load_naming_the_key(override, message):
  with pytest.raises(config_lib.ConfigError, match=message.replace(".", r"\.")):
    _load(override)


def test_reward_config_mapping_is_checked_field_by_field():
  with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'reward\.kwargs\.config\.corect_value'"):
    _load("reward.fn=math", "reward.kwargs={config: {corect_value: 5.0}}")
  assert _load("reward.fn=math", "reward.kwargs={config: {correct_value: 5.0}}").reward.kwargs["config"] == {
      "correct_value": 5.0}
