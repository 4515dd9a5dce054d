"""The clipped value loss against a float64 numpy reference, for every aggregation mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import losses

B, T, EPS = 4, 6, 0.2


def _inputs():
  rng = np.random.default_rng(3)
  mask = (rng.random((B, T)) < 0.8).astype(np.float32)
  mask[:, 0] = 1.0
  old = rng.normal(size=(B, T)).astype(np.float32)
  values = (old + rng.normal(scale=0.4, size=(B, T))).astype(np.float32)  # some beyond V_old ± ε, some inside
  returns = rng.normal(size=(B, T)).astype(np.float32)
  groups = np.array([0, 0, 1, 1], np.int32)
  return values, returns, old, mask, groups


def _reference(values, returns, old, mask, groups, *, mode, clip):
  """float64: per-token max((V-R)², (clip(V, V_old±ε)-R)²) aggregated by the mode's own definition."""
  v, r, o, m = (np.asarray(x, np.float64) for x in (values, returns, old, mask))
  per = (v - r) ** 2
  if clip is not None:
    per = np.maximum(per, (o + np.clip(v - o, -clip, clip) - r) ** 2)
  tok = per * m
  seqs = m.sum(1) > 0
  if mode == "token_mean":
    return tok.sum() / m.sum()
  if mode == "seq_mean_token_mean":
    return np.mean([tok[i].sum() / m[i].sum() for i in range(B) if seqs[i]])
  if mode == "seq_mean_token_sum":
    return tok.sum() / seqs.sum()
  if mode == "seq_mean_token_sum_norm":
    return tok.sum() / seqs.sum() / T
  assert mode == "prompt_mean"
  return np.mean([tok[groups == g].sum() / m[groups == g].sum() for g in np.unique(groups)])


@pytest.mark.parametrize("mode", losses.AGGREGATION_MODES)
@pytest.mark.parametrize("clip", [EPS, None])
def test_value_loss_matches_float64_reference_in_every_aggregation_mode(mode, clip):
  values, returns, old, mask, groups = _inputs()
  w = losses.loss_weights(jnp.asarray(mask), mode=mode, group_ids=jnp.asarray(groups), num_groups=2, max_len=T)
  loss, metrics = losses.value_loss(values=values, returns=returns, old_values=old, loss_weights=w, clip_range=clip)
  want = _reference(values, returns, old, mask, groups, mode=mode, clip=clip)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["value_loss"]), want, rtol=1e-5)


def test_both_branches_are_hit_and_the_clip_fraction_counts_the_clipped_one():
  values, returns, old, mask, _ = _inputs()
  v, r, o = (x.astype(np.float64) for x in (values, returns, old))
  unclipped = (v - r) ** 2
  clipped = (o + np.clip(v - o, -EPS, EPS) - r) ** 2
  valid = mask > 0
  frac = ((clipped > unclipped) & valid).sum() / valid.sum()
  assert 0 < frac < 1, "the inputs must exercise both branches of the max"
  w = losses.loss_weights(jnp.asarray(mask), mode="token_mean")
  loss_c, m = losses.value_loss(values=values, returns=returns, old_values=old, loss_weights=w, clip_range=EPS)
  loss_u, _ = losses.value_loss(values=values, returns=returns, old_values=old, loss_weights=w, clip_range=None)
  np.testing.assert_allclose(float(m["value_clip_frac"]) / float(m["weight_sum"]), frac, rtol=1e-6)
  assert float(loss_c) > float(loss_u)


def test_gradient_is_zero_where_the_clipped_branch_wins_and_masked_nans_are_ignored():
  values, returns, old, mask, _ = _inputs()
  mask[0, -1] = 0.0
  values[0, -1] = np.nan  # masked: must not reach the loss or the gradient
  w = losses.loss_weights(jnp.asarray(mask), mode="token_mean")
  fn = lambda v: losses.value_loss(values=v, returns=returns, old_values=old, loss_weights=w, clip_range=EPS)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(values))
  grad = np.asarray(grad)
  assert np.isfinite(float(loss)) and np.isfinite(grad).all()
  v, r, o = (x.astype(np.float64) for x in (values, returns, old))
  outside = np.abs(v - o) > EPS
  clip_wins = ((o + np.clip(v - o, -EPS, EPS) - r) ** 2 > (v - r) ** 2) & outside & (mask > 0)
  assert clip_wins.any()
  assert np.all(grad[clip_wins] == 0.0)
  plain = (~clip_wins) & (mask > 0)  # gradient of the unclipped branch: 2·w·(V − R)
  np.testing.assert_allclose(grad[plain], (2 * np.asarray(w) * (v - r))[plain], rtol=1e-5, atol=1e-7)


def test_bad_clip_range_is_refused():
  with pytest.raises(ValueError, match="clip_range"):
    losses.value_loss(values=jnp.zeros((1, 2)), returns=jnp.zeros((1, 2)), old_values=jnp.zeros((1, 2)),
                      loss_weights=jnp.ones((1, 2)), clip_range=0.0)
