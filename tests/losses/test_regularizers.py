"""Entropy, EM-FT/EM-RL, self-certainty, implicit PRM, entropy-regularised aggregation, Borda."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses._regularizers import (
    borda_vote,
    borda_weights,
    em_ft_loss,
    entropy_from_logits,
    entropy_from_logprobs,
    entropy_regularized_aggregate,
    implicit_prm_rewards,
    implicit_prm_step_rewards,
    negative_entropy_reward,
    negative_trajectory_entropy_reward,
    prime_process_advantages,
    self_certainty,
    self_certainty_reward,
)


def _logits(seed=0, b=2, t=7, v=11, scale=3.0):
  return np.random.default_rng(seed).normal(0, scale, (b, t, v))


def _np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def np_entropy(z, temperature=1.0):
  p = _np_softmax(z / temperature)
  return -(p * np.log(p)).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_from_logits_matches_float64_numpy(chunk_size, temperature):
  z = _logits()
  out = entropy_from_logits(jnp.asarray(z, jnp.float32), temperature=temperature, chunk_size=chunk_size)
  np.testing.assert_allclose(np.asarray(out), np_entropy(z, temperature), rtol=1e-5, atol=1e-6)


def test_entropy_of_uniform_is_log_v():
  out = entropy_from_logits(jnp.zeros((1, 5, 16), jnp.bfloat16), chunk_size=2)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.full((1, 5), math.log(16)), rtol=1e-6)


def test_chunked_entropy_gradient_equals_unchunked():
  z = jnp.asarray(_logits(1, t=10), jnp.float32)
  cot = jnp.asarray(np.random.default_rng(1).normal(size=(2, 10)), jnp.float32)
  grad = lambda c: jax.grad(lambda x: jnp.sum(cot * entropy_from_logits(x, chunk_size=c)))(z)
  np.testing.assert_allclose(np.asarray(grad(3)), np.asarray(grad(64)), rtol=1e-5, atol=1e-7)


def test_chunked_entropy_keeps_float32_temporaries_chunk_sized():
  # One float32 [T, V] block is 2 MiB here. Chunked forward: temporaries stay far below one block;
  # backward: only the [T, V] gradient buffer itself; unchunked needs at least two blocks.
  z = jnp.zeros((1, 1024, 512), jnp.float32)
  block = 1024 * 512 * 4

  def temp(fn, chunk):
    return jax.jit(fn(chunk)).lower(z).compile().memory_analysis().temp_size_in_bytes

  fwd = lambda c: lambda x: entropy_from_logits(x, chunk_size=c).sum()
  bwd = lambda c: jax.grad(fwd(c))
  assert temp(fwd, 16) < block / 8
  assert temp(bwd, 16) < 1.25 * block
  assert temp(fwd, 1024) >= block and temp(bwd, 1024) >= 2 * block


def test_entropy_from_logprobs_matches_logits_and_handles_minus_inf():
  z = _logits(2)
  z[0, 0, :5] = -np.inf
  lp = jax.nn.log_softmax(jnp.asarray(z, jnp.float32), axis=-1)
  out = entropy_from_logprobs(lp, chunk_size=3)
  p = _np_softmax(z)
  expected = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


def test_em_ft_loss_is_weighted_entropy_and_differentiable():
  z = jnp.asarray(_logits(3), jnp.float32)
  w = jnp.full((2, 7), 1 / 14)
  loss, metrics = em_ft_loss(entropy=entropy_from_logits(z), loss_weights=w)
  np.testing.assert_allclose(float(loss), np_entropy(_logits(3)).mean(), rtol=1e-5)
  g = jax.grad(lambda x: em_ft_loss(entropy=entropy_from_logits(x), loss_weights=w)[0])(z)
  assert float(em_ft_loss(entropy=entropy_from_logits(z - 0.1 * g), loss_weights=w)[0]) < float(loss)


def test_negative_entropy_rewards_match_float64_numpy():
  rng = np.random.default_rng(4)
  h = rng.uniform(0, 2, (3, 5))
  lp = -rng.uniform(0, 3, (3, 5))
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.float32)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  np.testing.assert_allclose(np.asarray(negative_entropy_reward(f32(h), f32(mask))), -(h * mask).sum(-1),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(negative_entropy_reward(f32(h), f32(mask), length_normalize=True)),
                             [-(h[0, :3]).mean(), -h[1].mean(), 0.0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(negative_trajectory_entropy_reward(f32(lp), f32(mask))),
                             (lp * mask).sum(-1), rtol=1e-6)


def test_self_certainty_matches_kl_uniform_to_p():
  z = _logits(5)
  p = _np_softmax(z)
  v = z.shape[-1]
  expected = (np.log(1.0 / v) - np.log(p)).sum(-1) / v  # KL(U‖p) = Σ_j (1/V) log((1/V)/p_j)
  out = self_certainty(jnp.asarray(z, jnp.float32), chunk_size=3)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(self_certainty(jnp.zeros((1, 2, 9)))), 0.0, atol=1e-6)


def test_self_certainty_reward_is_response_mean():
  z = _logits(6)
  mask = np.array([[1, 1, 0, 0, 0, 0, 0], [1] * 7], np.float32)
  per_token = np.asarray(self_certainty(jnp.asarray(z, jnp.float32)))
  out = self_certainty_reward(jnp.asarray(z, jnp.float32), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(out), [per_token[0, :2].mean(), per_token[1].mean()], rtol=1e-6)


def test_implicit_prm_rewards_and_step_sums():
  lp = np.log([[0.5, 0.4, 0.2, 0.9]])
  ref = np.log([[0.25, 0.4, 0.4, 0.9]])
  mask = np.array([[1, 1, 1, 0]], np.float32)
  q = implicit_prm_rewards(*[jnp.asarray(x, jnp.float32) for x in (lp, ref, mask)], beta=0.5)
  np.testing.assert_allclose(np.asarray(q), [[0.5 * math.log(2), 0, -0.5 * math.log(2), 0]], rtol=1e-6,
                             atol=1e-7)
  steps = implicit_prm_step_rewards(q, jnp.asarray([[1, 1, 2, 0]]), num_steps=3)
  np.testing.assert_allclose(np.asarray(steps), [[0.5 * math.log(2), -0.5 * math.log(2), 0.0]], rtol=1e-6)


def _np_prime(r, mask, groups):
  """float64 loops, as PRIME's ``masked_rloo`` + reversed cumsum read: per group of K, each response's masked
  mean; every masked token becomes ``r·K/(K−1) − Σ_j mean_j/(K−1)``; then the return-to-go over the response."""
  out = np.zeros(r.shape)
  for g in np.unique(groups):
    members = np.flatnonzero(groups == g)
    k = len(members)
    if k < 2:
      continue
    means = [r[i][mask[i] > 0].mean() if mask[i].any() else 0.0 for i in members]
    for i in members:
      tilde = np.where(mask[i] > 0, r[i] * k / (k - 1) - sum(means) / (k - 1), 0.0)
      for t in range(r.shape[1]):
        out[i, t] = tilde[t:].sum() if mask[i, t] > 0 else 0.0
  return out


def test_prime_process_advantages_hand_example_and_float64_loops():
  # One group of K = 2, one token each after the first: r = [[1, 3], [2, _]] (second response 1 token).
  # Means 2 and 2; tilde = 2r − 4: [[-2, 2], [0]]; return-to-go: [[0, 2], [0]].
  r = np.array([[1.0, 3.0], [2.0, 9.0]])
  mask = np.array([[1, 1], [1, 0]], np.float32)
  got = prime_process_advantages(jnp.asarray(r, jnp.float32), jnp.asarray(mask), jnp.asarray([0, 0]), num_groups=1)
  np.testing.assert_allclose(np.asarray(got), [[0.0, 2.0], [0.0, 0.0]], atol=1e-6)
  # Random: groups of 4, 3 and 1 (the singleton gets 0), ragged masks, an empty response.
  rng = np.random.default_rng(3)
  groups = np.array([0, 0, 0, 0, 1, 1, 1, 2])
  r = rng.normal(size=(8, 6))
  lengths = np.array([6, 3, 1, 5, 0, 2, 6, 4])
  mask = (np.arange(6)[None] < lengths[:, None]).astype(np.float32)
  got = np.asarray(prime_process_advantages(jnp.asarray(r, jnp.float32), jnp.asarray(mask), jnp.asarray(groups),
                                            num_groups=3))
  want = _np_prime(r, mask, groups)
  assert np.abs(want).max() > 0.5 and not got[7].any()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Each response's first-token advantage equals the paper's form summed: Σ_t r_{i,t} − |y_i| · mean_{j≠i} mean_j.
  i, members = 1, np.flatnonzero(groups == 0)
  others = [r[j][mask[j] > 0].mean() for j in members if j != i]
  np.testing.assert_allclose(got[i, 0], r[i, :3].sum() - 3 * np.mean(others), rtol=1e-5)


def test_entropy_regularized_aggregate_matches_float64_numpy():
  rng = np.random.default_rng(7)
  r = rng.uniform(0, 1, (3, 8))
  p = rng.dirichlet(np.ones(8), size=3)
  for eta in (0.5, 2.0, -1.0, 10.0):
    out = entropy_regularized_aggregate(jnp.asarray(r, jnp.float32), eta=eta, probs=jnp.asarray(p, jnp.float32))
    np.testing.assert_allclose(np.asarray(out), np.log((p * np.exp(eta * r)).sum(-1)) / eta, rtol=1e-5)


def test_entropy_regularized_aggregate_hand_example_and_limits():
  r = jnp.asarray([[0.0, 1.0]])
  np.testing.assert_allclose(float(entropy_regularized_aggregate(r, eta=1.0)[0]), math.log((1 + math.e) / 2),
                             rtol=1e-6)
  assert float(entropy_regularized_aggregate(r, eta=0.0)[0]) == 0.5  # soft label Σ p r
  np.testing.assert_allclose(float(entropy_regularized_aggregate(r, eta=1e-3)[0]), 0.5, atol=1e-3)
  np.testing.assert_allclose(float(entropy_regularized_aggregate(r, eta=1e3)[0]), 1.0, atol=1e-3)  # max
  masked = entropy_regularized_aggregate(jnp.asarray([[0.0, 1.0, 9.0], [5.0, 5.0, 5.0]]), eta=1.0,
                                         mask=jnp.asarray([[1, 1, 0], [0, 0, 0]]))
  np.testing.assert_allclose(np.asarray(masked), [math.log((1 + math.e) / 2), 0.0], rtol=1e-6)


def test_borda_weights_hand_example():
  np.testing.assert_array_equal(np.asarray(borda_weights(jnp.arange(1, 7))), [6, 5, 4, 3, 2, 1])
  np.testing.assert_array_equal(np.asarray(borda_weights(jnp.arange(1, 4), p=2.0)), [9, 4, 1])


def test_borda_vote_sums_weights_per_answer():
  # Answers [A, B, A, C] ranked [1, 2, 3, 4] with N = 4, p = 1: A = 4 + 2, B = 3, C = 1.
  scores = borda_vote(jnp.asarray([0, 1, 0, 2]), jnp.asarray([1, 2, 3, 4]), num_answers=3)
  np.testing.assert_array_equal(np.asarray(scores), [6, 3, 1])
