"""Off-policy corrections: float64 references, hand examples, composition with objectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses._corrections import (
    DIVERGENCE_LEVELS,
    divergence_rejection_mask,
    icepop_weights,
    off_policy_sequence_mask,
    sequence_mask_weights,
    tis_weights,
    token_mask_weights,
)
from jaxrl.losses._policy import OBJECTIVES

B, T = 6, 7


def _batch(seed=0, spread=0.5):
  rng = np.random.default_rng(seed)
  rollout = -rng.uniform(0.05, 3.0, (B, T))
  train = rollout + rng.normal(0, spread, (B, T))
  mask = (rng.uniform(size=(B, T)) > 0.25).astype(np.float64)
  mask[:, 0] = 1.0
  mask[3] = 0.0
  adv = rng.normal(size=(B, 1)) * np.ones((B, T))
  return train, rollout, mask, adv


def _f32(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


def _np_seq_log_ratio(x, mask, level):
  if level == "token":
    return x
  s = (x * mask).sum(-1, keepdims=True)
  if level == "sequence":
    return np.broadcast_to(s, x.shape)
  n = mask.sum(-1, keepdims=True)
  return np.broadcast_to(np.where(n > 0, s / np.maximum(n, 1), 0.0), x.shape)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_tis_weights_match_float64_numpy(level):
  train, rollout, mask, _ = _batch(spread=0.15)
  w = tis_weights(*_f32(train, rollout, mask), cap=1.5, level=level)
  expected = np.minimum(np.exp(_np_seq_log_ratio(train - rollout, mask, level)), 1.5) * mask
  np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-5, atol=1e-7)


def test_tis_hand_example():
  # ρ = [0.5, 1.0, 3.0], C = 2: token [0.5, 1, 2]; sequence Π ρ = 1.5 → 1.5 everywhere.
  train = np.log([[0.5, 1.0, 3.0]])
  rollout = np.zeros((1, 3))
  mask = np.ones((1, 3))
  np.testing.assert_allclose(np.asarray(tis_weights(*_f32(train, rollout, mask), cap=2.0)), [[0.5, 1, 2]],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(tis_weights(*_f32(train, rollout, mask), cap=2.0, level="sequence")),
                             [[1.5, 1.5, 1.5]], rtol=1e-6)


def test_token_mask_weights_match_float64_numpy():
  train, rollout, mask, _ = _batch(1)
  r = np.exp(train - rollout)
  w = token_mask_weights(*_f32(train, rollout, mask), upper=1.8, lower=0.6)
  np.testing.assert_allclose(np.asarray(w), np.where((r >= 0.6) & (r <= 1.8), r, 0) * mask, rtol=1e-5)


def test_icepop_hand_example():
  # α = 0.5, β = 5: ρ = [0.4, 0.5, 2, 5, 6] → [0, 0.5, 2, 5, 0].
  train = np.log([[0.4, 0.5, 2.0, 5.0, 6.0]])
  w = icepop_weights(*_f32(train, np.zeros((1, 5)), np.ones((1, 5))))
  np.testing.assert_allclose(np.asarray(w), [[0, 0.5, 2, 5, 0]], rtol=1e-5)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_mask_weights_match_float64_numpy(level):
  train, rollout, mask, _ = _batch(2, spread=0.2)
  r = np.exp(_np_seq_log_ratio(train - rollout, mask, level))
  w = sequence_mask_weights(*_f32(train, rollout, mask), upper=1.5, lower=0.7, level=level)
  np.testing.assert_allclose(np.asarray(w), np.where((r >= 0.7) & (r <= 1.5), r, 0) * mask, rtol=1e-5)


def _np_divergence(x, mask, estimator, level):
  stat = {"k1": -x, "k2": 0.5 * x * x, "k3": np.exp(x) - 1 - x}[estimator]
  if level == "token":
    return stat
  if level == "seq_sum":
    return np.broadcast_to((stat * mask).sum(-1, keepdims=True), x.shape)
  if level == "seq_mean":
    n = mask.sum(-1, keepdims=True)
    return np.broadcast_to(np.where(n > 0, (stat * mask).sum(-1, keepdims=True) / np.maximum(n, 1), 0), x.shape)
  m = np.where(mask > 0, stat, -np.inf).max(-1, keepdims=True)
  return np.broadcast_to(np.where(np.isfinite(m), m, 0.0), x.shape)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("level", DIVERGENCE_LEVELS)
def test_divergence_rejection_matches_float64_numpy(estimator, level):
  train, rollout, mask, _ = _batch(3, spread=0.3)
  x = train - rollout
  stat = _np_divergence(x, mask, estimator, level)
  vals = np.unique(stat[mask > 0])
  between = lambda q: float(0.5 * (vals[int(q * len(vals)) - 1] + vals[int(q * len(vals))]))  # no ties
  upper = between(0.75 if estimator == "k1" else 0.5)
  lower = between(0.25) if estimator == "k1" else None
  keep = stat <= upper
  if lower is not None:
    keep &= stat >= lower
  out = divergence_rejection_mask(*_f32(train, rollout, mask), estimator=estimator, level=level, upper=upper,
                                  lower=lower)
  np.testing.assert_array_equal(np.asarray(out), (keep & (mask > 0)).astype(np.float32))
  assert 0 < float(out.sum()) < mask.sum()  # the threshold actually splits the batch


def test_divergence_rejection_k3_hand_example():
  # log ρ = [0, log 2]: k3 = [0, 2 - 1 - log 2 = 0.3069]; seq_max 0.3069 > 0.3 rejects the sequence.
  train = np.array([[0.0, np.log(2.0)]])
  zeros, ones = np.zeros((1, 2)), np.ones((1, 2))
  tok = divergence_rejection_mask(*_f32(train, zeros, ones), estimator="k3", level="token", upper=0.3)
  seq = divergence_rejection_mask(*_f32(train, zeros, ones), estimator="k3", level="seq_max", upper=0.3)
  np.testing.assert_array_equal(np.asarray(tok), [[1, 0]])
  np.testing.assert_array_equal(np.asarray(seq), [[0, 0]])


def test_off_policy_sequence_mask_matches_float64_numpy():
  train, rollout, mask, adv = _batch(4, spread=0.8)
  n = mask.sum(-1, keepdims=True)
  seq_kl = np.where(n > 0, ((rollout - train) * mask).sum(-1, keepdims=True) / np.maximum(n, 1), 0)
  keep = (adv >= 0) | (seq_kl <= 0.1)
  out = off_policy_sequence_mask(*_f32(train, rollout, adv, mask), threshold=0.1)
  np.testing.assert_array_equal(np.asarray(out), (keep & (mask > 0)).astype(np.float32))


def test_off_policy_sequence_mask_keeps_positive_advantages():
  # Both sequences drifted by 1 nat/token; only the negative-advantage one is dropped.
  train = np.full((2, 3), -2.0)
  rollout = np.full((2, 3), -1.0)
  out = off_policy_sequence_mask(*_f32(train, rollout, np.array([1.0, -1.0]), np.ones((2, 3))), threshold=0.5)
  np.testing.assert_array_equal(np.asarray(out), [[1, 1, 1], [0, 0, 0]])


def test_packed_sequences_equal_rows():
  train, rollout, mask, _ = _batch(5, spread=0.2)
  rows = tis_weights(*_f32(train, rollout, mask), cap=3.0, level="sequence")
  seg = np.tile(np.repeat([1, 2], T), (B // 2, 1))
  packed = tis_weights(*_f32(train.reshape(B // 2, 2 * T), rollout.reshape(B // 2, 2 * T),
                             mask.reshape(B // 2, 2 * T)), cap=3.0, level="sequence", segment_ids=jnp.asarray(seg))
  np.testing.assert_allclose(np.asarray(packed), np.asarray(rows).reshape(B // 2, 2 * T), rtol=1e-6)


def test_corrections_are_stop_gradient():
  train, rollout, mask, adv = _batch(6)
  _, rollout_j, mask_j, adv_j = _f32(train, rollout, mask, adv)
  fns = [
      lambda x: tis_weights(x, rollout_j, mask_j, level="sequence"),
      lambda x: token_mask_weights(x, rollout_j, mask_j),
      lambda x: sequence_mask_weights(x, rollout_j, mask_j),
      lambda x: divergence_rejection_mask(x, rollout_j, mask_j, upper=0.1),
      lambda x: off_policy_sequence_mask(x, rollout_j, adv_j, mask_j),
  ]
  for fn in fns:
    g = jax.grad(lambda x: jnp.sum(fn(x)))(jnp.asarray(train, jnp.float32))
    assert bool(jnp.all(g == 0))


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "decoupled_ppo"])
def test_weights_compose_with_any_objective(name):
  train, rollout, mask, adv = _batch(7, spread=0.2)
  rng = np.random.default_rng(7)
  lp = train + rng.normal(0, 0.1, (B, T))
  w = mask / mask.sum()
  isw = tis_weights(*_f32(train, rollout, mask), cap=1.5) * divergence_rejection_mask(
      *_f32(train, rollout, mask), upper=0.05, level="token")
  options = {"prox_logprobs": jnp.asarray(train, jnp.float32)} if name == "decoupled_ppo" else {}
  lp_j, old_j, adv_j, w_j = _f32(lp, rollout if name == "decoupled_ppo" else train, adv, w)
  fn = OBJECTIVES[name]

  def loss(isw_arg, w_arg):
    return fn(logprobs=lp_j, old_logprobs=old_j, advantages=adv_j, loss_weights=w_arg, is_weights=isw_arg,
              **options)[0]

  # is_weights multiply the per-token surrogate: equal to folding them into the weights (token-local
  # objectives) — and 0-weight tokens get exactly zero gradient.
  with_isw = loss(isw, w_j)
  if name != "gspo":  # GSPO's sequence ratio uses the response mask, which is_weights do not change
    np.testing.assert_allclose(float(with_isw), float(loss(None, w_j * isw)), rtol=1e-6, atol=1e-8)
  g = jax.grad(lambda x: fn(logprobs=x, old_logprobs=old_j, advantages=adv_j, loss_weights=w_j, is_weights=isw,
                            **options)[0])(lp_j)
  assert bool(jnp.all(jnp.where(isw == 0, g, 0.0) == 0))
  assert bool(jnp.any(g != 0))


def test_empty_mask_and_overflow_are_finite():
  train, rollout, mask, adv = _batch(8)
  train = train + np.where(np.arange(T) % 2, 50.0, -50.0)
  for m in (mask, np.zeros_like(mask)):
    args = _f32(train, rollout, m)
    outs = [tis_weights(*args, level="sequence"), token_mask_weights(*args), sequence_mask_weights(*args),
            divergence_rejection_mask(*args, upper=1.0, level="seq_mean"),
            off_policy_sequence_mask(args[0], args[1], jnp.asarray(adv, jnp.float32), args[2])]
    assert all(bool(jnp.all(jnp.isfinite(o))) for o in outs)


def test_invalid_levels_raise():
  args = _f32(*_batch()[:3])
  with pytest.raises(ValueError, match="level"):
    tis_weights(*args, level="seq")
  with pytest.raises(ValueError, match="level"):
    sequence_mask_weights(*args, level="token")
  with pytest.raises(ValueError, match="estimator"):
    divergence_rejection_mask(*args, estimator="k4", upper=1.0)
  with pytest.raises(ValueError, match="level"):
    divergence_rejection_mask(*args, level="seq_min", upper=1.0)
