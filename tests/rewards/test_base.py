"""Reward interface: loading by import path and result validation."""

import math
import textwrap

import numpy as np
import pytest

from jaxrl.config import ConfigError
from jaxrl.rewards import MathRewardConfig, RewardResult, RewardValueError, coerce_reward, load_reward, math_reward
from jaxrl.rewards._base import as_config


def test_load_reward_by_public_module_path():
  fn = load_reward("jaxrl.rewards.math:math_reward")
  assert fn is math_reward


def test_load_reward_by_private_module_path_and_short_name():
  assert load_reward("jaxrl.rewards._math:math_reward") is math_reward
  assert load_reward("math") is math_reward


def test_load_reward_from_user_module(tmp_path, monkeypatch):
  (tmp_path / "my_user_rewards.py").write_text(textwrap.dedent("""
    def shout(prompt, completion, **_):
      return float(completion.isupper())
  """))
  monkeypatch.syspath_prepend(str(tmp_path))
  fn = load_reward("my_user_rewards:shout")
  assert fn("p", "HI") == 1.0 and fn("p", "hi") == 0.0


def test_load_reward_binds_kwargs():
  fn = load_reward("math", config=MathRewardConfig.areal())
  assert fn("Q", "so 3", answer="3").value == 5.0


@pytest.mark.parametrize("spec, error", [
  ("jaxrl.rewards.math", ValueError),
  ("no_such_module_xyz:f", ImportError),
  ("jaxrl.rewards._math:no_such_fn", AttributeError),
  ("jaxrl.rewards._math:__all__", TypeError),
])
def test_load_reward_errors_name_the_spec(spec, error):
  with pytest.raises(error, match="reward"):
    load_reward(spec)


@pytest.mark.parametrize("value", [1, 0.5, np.float32(0.25), np.array(2.0), np.int64(3)])
def test_coerce_accepts_real_scalars(value):
  assert coerce_reward(value).value == float(value)


@pytest.mark.parametrize("value, reason", [
  (math.nan, "non_finite"), (-math.inf, "non_finite"), ("1", "wrong_type"), (None, "wrong_type"),
  (True, "wrong_type"), (np.ones(2), "wrong_shape"), (RewardResult(value=math.nan), "non_finite"),
])
def test_coerce_rejects_bad_values_with_reason(value, reason):
  with pytest.raises(RewardValueError) as e:
    coerce_reward(value)
  assert e.value.reason == reason


def test_config_from_dict_checks_keys_and_types():
  assert as_config(MathRewardConfig, {"correct_value": 5}, "config").correct_value == 5.0
  with pytest.raises(ConfigError, match="config.bogus"):
    as_config(MathRewardConfig, {"bogus": 1}, "config")
  with pytest.raises(ConfigError, match="config.correct_value"):
    as_config(MathRewardConfig, {"correct_value": "high"}, "config")
