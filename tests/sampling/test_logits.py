"""Sampling math on fixed logits: truncation sets, sampled frequencies, log-prob conventions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import sampling

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
DRAWS = 20000


@jax.jit
def _sample(logits, keys, temperature, top_k, top_p, min_p):
  return sampling.sample_logits(logits, keys, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _reference_distribution(logits, *, temperature, top_k, top_p, min_p):
  """Truncated, renormalised distribution with a full sort (numpy, float64)."""
  z = logits.astype(np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  keep = np.zeros_like(p, bool)
  k = len(p) if top_k == 0 else min(top_k, len(p))
  keep[order[:k]] = True
  mass = p[order[:k]].sum()
  cum = np.cumsum(p[order[:k]])
  last = int(np.argmax(cum >= top_p * mass)) if top_p < 1 else k - 1
  nucleus = np.zeros_like(keep)
  nucleus[order[:last + 1]] = True
  keep &= nucleus
  keep &= p >= min_p * p.max()
  q = np.where(keep, p, 0.0)
  return q / q.sum()


def _run(rows, logits, *, temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0):
  keys = jax.random.split(jax.random.key(seed), rows)
  full = lambda x, dt: jnp.full((rows,), x, dt)
  return _sample(jnp.broadcast_to(jnp.asarray(logits), (rows, len(logits))), keys, full(temperature, jnp.float32),
                 full(top_k, jnp.int32), full(top_p, jnp.float32), full(min_p, jnp.float32))


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, min_p=0.2),
    dict(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05),
])
def test_sampled_frequencies_match_truncated_renormalised_distribution(params):
  out = _run(DRAWS, LOGITS, **params)
  freq = np.bincount(np.asarray(out.tokens), minlength=len(LOGITS)) / DRAWS
  q = _reference_distribution(LOGITS, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **params})
  assert (freq[q == 0] == 0).all(), (freq, q)
  sigma = np.sqrt(q * (1 - q) / DRAWS)
  assert (np.abs(freq - q) <= 5 * sigma + 1e-12).all(), (freq, q)


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=3), dict(temperature=1.3, top_k=5, top_p=0.9)])
def test_logprob_conventions_full_and_renormalised(params):
  out = _run(DRAWS, LOGITS, **params)
  t = params["temperature"]
  full = jax.nn.log_softmax(LOGITS / t)
  q = _reference_distribution(LOGITS, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **params})
  tokens = np.asarray(out.tokens)
  np.testing.assert_allclose(out.logprobs, np.asarray(full)[tokens], atol=1e-6)
  np.testing.assert_allclose(out.sampling_logprobs, np.log(q[tokens]), atol=1e-5)


def test_truncation_mask_matches_sorted_reference_per_row():
  rng = np.random.default_rng(0)
  rows, vocab = 64, 50
  logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
  top_k = rng.integers(0, vocab + 5, size=rows).astype(np.int32)
  top_p = rng.uniform(0.05, 1.0, size=rows).astype(np.float32)
  top_p[::4] = 1.0
  min_p = np.where(rng.uniform(size=rows) < 0.5, 0.0, rng.uniform(0, 0.5, size=rows)).astype(np.float32)
  mask = np.asarray(jax.jit(sampling.truncation_mask)(jnp.asarray(logits), top_k=jnp.asarray(top_k),
                                                     top_p=jnp.asarray(top_p), min_p=jnp.asarray(min_p)))
  for r in range(rows):
    q = _reference_distribution(logits[r], temperature=1.0, top_k=int(top_k[r]), top_p=float(top_p[r]),
                                min_p=float(min_p[r]))
    np.testing.assert_array_equal(mask[r], q > 0, err_msg=f"row {r}")


def test_greedy_rows_take_argmax_with_full_logprob():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(8, 30)).astype(np.float32)
  keys = jax.random.split(jax.random.key(0), 8)
  out = _sample(jnp.asarray(logits), keys, jnp.zeros(8), jnp.zeros(8, jnp.int32), jnp.ones(8), jnp.zeros(8))
  np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
  np.testing.assert_allclose(out.logprobs, np.asarray(jax.nn.log_softmax(logits))[np.arange(8), logits.argmax(-1)],
                             atol=1e-6)
  np.testing.assert_array_equal(out.sampling_logprobs, 0.0)


def test_row_draw_depends_only_on_its_own_key():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(8, 30)).astype(np.float32)
  keys = jax.random.split(jax.random.key(3), 8)
  ones, zeros = jnp.ones(8), jnp.zeros(8)
  batch = _sample(jnp.asarray(logits), keys, ones, jnp.zeros(8, jnp.int32), ones, zeros)
  perm = np.array([5, 2, 7, 0, 1, 3, 6, 4])
  shuffled = _sample(jnp.asarray(logits[perm]), keys[perm], ones, jnp.zeros(8, jnp.int32), ones, zeros)
  np.testing.assert_array_equal(np.asarray(shuffled.tokens), np.asarray(batch.tokens)[perm])


def test_inverse_cdf_matches_numpy_searchsorted_and_never_picks_zero_mass():
  from jaxrl.sampling._logits import _inverse_cdf
  rng = np.random.default_rng(4)
  rows, vocab = 256, 1003  # not a multiple of the ~sqrt(V) block size: padding is exercised
  probs = rng.exponential(size=(rows, vocab)).astype(np.float32)
  probs[rng.uniform(size=probs.shape) < 0.6] = 0.0
  probs[:8, :] = 0.0
  probs[:8, 5] = 1.0  # one-token rows
  u = rng.uniform(size=rows).astype(np.float32)
  u[8:16] = np.nextafter(np.float32(1.0), np.float32(0.0))  # the top of [0, 1)
  u[16:24] = 0.0
  got = np.asarray(jax.jit(_inverse_cdf)(jnp.asarray(probs), jnp.asarray(u)))
  assert (probs[np.arange(rows), got] > 0).all()
  cum = np.cumsum(probs.astype(np.float64), axis=1)
  want = np.array([np.searchsorted(cum[r], u[r] * cum[r, -1], side="right") for r in range(rows)])
  far = np.abs(cum[np.arange(rows), np.minimum(want, vocab - 1)] - u * cum[:, -1]) > 1e-4 * cum[:, -1]
  np.testing.assert_array_equal(got[8:][far[8:]], want[8:][far[8:]])
  np.testing.assert_array_equal(got[:8], 5)
