"""KL estimators, straight-through variants, KL loss / penalised rewards and controllers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses._kl import (
    KL,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl_loss,
    kl_penalized_rewards,
)

NP_KL = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x * x,
    "k3": lambda x: np.exp(-x) - 1 + x,
    "abs": np.abs,
    "low_var_kl": lambda x: np.clip(np.exp(-x) - 1 + x, -10, 10),
}


def _pair(seed=0):
  rng = np.random.default_rng(seed)
  ref = -rng.uniform(0.05, 3.0, (4, 6))
  lp = ref + rng.normal(0, 0.7, (4, 6))
  return lp, ref


def _f32(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize("name", sorted(KL))
def test_estimator_value_matches_float64_numpy(name):
  lp, ref = _pair()
  out = KL[name](*_f32(lp, ref))
  np.testing.assert_allclose(np.asarray(out), NP_KL[name.rstrip("+")](lp - ref), rtol=1e-5, atol=1e-6)


def test_estimators_hand_example():
  # x = log π_θ - log π_ref = log 2: k1 = 0.6931, k2 = 0.2402, k3 = 1/2 - 1 + log 2 = 0.1931.
  lp, ref = _f32([[math.log(0.5)]], [[math.log(0.25)]])
  np.testing.assert_allclose(float(KL["k1"](lp, ref)[0, 0]), math.log(2), rtol=1e-6)
  np.testing.assert_allclose(float(KL["k2"](lp, ref)[0, 0]), 0.5 * math.log(2) ** 2, rtol=1e-6)
  np.testing.assert_allclose(float(KL["k3"](lp, ref)[0, 0]), 0.5 - 1 + math.log(2), rtol=1e-5)
  g = jax.grad(lambda x: KL["k3"](x, ref).sum())(lp)
  np.testing.assert_allclose(float(g[0, 0]), 0.5, rtol=1e-6)  # 1 - π_ref/π_θ


NP_GRAD = {"k1": lambda x: np.ones_like(x), "k2": lambda x: x, "k3": lambda x: 1 - np.exp(-x),
           "abs": np.sign}


@pytest.mark.parametrize("name", sorted(NP_GRAD))
def test_estimator_gradient_matches_float64_numpy(name):
  lp, ref = _pair(1)
  g = jax.grad(lambda x: KL[name](x, jnp.asarray(ref, jnp.float32)).sum())(jnp.asarray(lp, jnp.float32))
  np.testing.assert_allclose(np.asarray(g), NP_GRAD[name](lp - ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["k1+", "k3+", "abs+", "low_var_kl+"])
def test_straight_through_has_base_value_and_k2_gradient(name):
  lp, ref = _f32(*_pair(2))
  np.testing.assert_array_equal(np.asarray(KL[name](lp, ref)), np.asarray(KL[name[:-1]](lp, ref)))
  g = jax.grad(lambda x: KL[name](x, ref).sum())(lp)
  g2 = jax.grad(lambda x: KL["k2"](x, ref).sum())(lp)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(g2))


def test_reference_logprobs_get_no_gradient():
  lp, ref = _f32(*_pair(3))
  for name, fn in KL.items():
    g = jax.grad(lambda r: fn(lp, r).sum())(ref)
    assert bool(jnp.all(g == 0)), name


def test_kl_loss_matches_float64_numpy_and_ignores_masked_inf():
  lp, ref = _pair(4)
  mask = (np.random.default_rng(4).uniform(size=lp.shape) > 0.3).astype(np.float64)
  w = mask / mask.sum()
  lp_inf = np.where(mask > 0, lp, -np.inf)
  loss, metrics = kl_loss(logprobs=jnp.asarray(lp_inf, jnp.float32), ref_logprobs=jnp.asarray(ref, jnp.float32),
                          loss_weights=jnp.asarray(w, jnp.float32), estimator="k3")
  np.testing.assert_allclose(float(loss), np.sum(w * NP_KL["k3"](lp - ref)), rtol=1e-5)
  assert float(metrics["kl"]) == float(loss)
  g = jax.grad(lambda x: kl_loss(logprobs=x, ref_logprobs=jnp.asarray(ref, jnp.float32),
                                 loss_weights=jnp.asarray(w, jnp.float32))[0])(jnp.asarray(lp_inf, jnp.float32))
  assert bool(jnp.all(jnp.isfinite(g)))


def test_kl_penalized_rewards_places_sequence_reward_on_last_token():
  lp = np.log([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
  ref = np.log([[0.25, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
  mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0]], np.float32)
  rewards, kl = kl_penalized_rewards(jnp.asarray([1.0, 2.0]), *_f32(lp, ref, mask), kl_coef=0.1)
  np.testing.assert_allclose(np.asarray(kl), [[math.log(2), 0, 0, 0], [0, 0, 0, 0]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(rewards), [[-0.1 * math.log(2), 0, 1.0, 0], [0, 0, 0, 0]], rtol=1e-6,
                             atol=1e-7)


def test_kl_penalized_token_rewards_match_float64_numpy():
  lp, ref = _pair(5)
  rng = np.random.default_rng(5)
  mask = (rng.uniform(size=lp.shape) > 0.3).astype(np.float64)
  r = rng.normal(size=lp.shape)
  out, kl = kl_penalized_rewards(*_f32(r, lp, ref, mask), kl_coef=0.05, estimator="k3")
  np.testing.assert_allclose(np.asarray(out), (r - 0.05 * NP_KL["k3"](lp - ref)) * mask, rtol=1e-5, atol=1e-6)


def test_fixed_controller_keeps_coefficient():
  ctl = fixed_kl_controller(0.05)
  state = ctl.init()
  for kl in (0.0, 1.0, 100.0):
    state = ctl.update(state, kl, 8)
  np.testing.assert_allclose(float(state.coef), 0.05, rtol=1e-7)


def test_adaptive_controller_matches_ziegler_update():
  ctl = adaptive_kl_controller(0.2, target=6.0, horizon=10000)
  update = jax.jit(ctl.update)
  state, coef = ctl.init(), 0.2
  for kl, n in [(3.0, 256), (6.0, 256), (12.0, 512), (7.0, 128), (0.0, 1024)]:
    state = update(state, kl, n)
    coef *= 1 + np.clip(kl / 6.0 - 1, -0.2, 0.2) * n / 10000
    np.testing.assert_allclose(float(state.coef), coef, rtol=1e-6)


def test_unknown_estimator_raises():
  lp, ref = _f32(*_pair())
  with pytest.raises(ValueError, match="unknown KL estimator"):
    kl_loss(logprobs=lp, ref_logprobs=ref, loss_weights=jnp.ones_like(lp), estimator="k4")
