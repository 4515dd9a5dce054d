"""Overlong filtering mask and DAPO's soft overlong penalty."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses._aggregate import loss_weights
from jaxrl.losses._overlong import dapo_overlong_penalty, overlong_filter_mask


def test_overlong_filter_masks_truncated_rows():
  mask = jnp.asarray([[1, 1, 0], [1, 1, 1], [1, 0, 0]], jnp.float32)
  out = overlong_filter_mask(mask, jnp.asarray([False, True, False]))
  np.testing.assert_array_equal(np.asarray(out), [[1, 1, 0], [0, 0, 0], [1, 0, 0]])


def test_overlong_filter_accepts_per_token_flags():
  mask = jnp.ones((1, 4))
  out = overlong_filter_mask(mask, jnp.asarray([[False, False, True, True]]))
  np.testing.assert_array_equal(np.asarray(out), [[1, 1, 0, 0]])


def test_filtered_responses_leave_the_normaliser():
  mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
  w = loss_weights(overlong_filter_mask(mask, jnp.asarray([False, True])), mode="token_mean")
  np.testing.assert_allclose(np.asarray(w), [[0.5, 0.5, 0], [0, 0, 0]])


def test_dapo_penalty_hand_example():
  # L_max = 20, L_cache = 4: free up to 16, linear to -1 at 20, -1 beyond.
  out = dapo_overlong_penalty(jnp.asarray([10, 16, 17, 18, 20, 21, 100]), max_len=20, cache_len=4)
  np.testing.assert_allclose(np.asarray(out), [0, 0, -0.25, -0.5, -1, -1, -1], rtol=1e-6)


def test_dapo_penalty_matches_float64_numpy():
  lengths = np.random.default_rng(0).integers(0, 5000, 256)
  l_max, l_cache = 4096, 512
  expected = np.where(lengths <= l_max - l_cache, 0.0,
                      np.where(lengths <= l_max, (l_max - l_cache - lengths) / l_cache, -1.0))
  out = dapo_overlong_penalty(jnp.asarray(lengths), max_len=l_max, cache_len=l_cache)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)


def test_dapo_penalty_rejects_bad_cache_len():
  with pytest.raises(ValueError, match="cache_len"):
    dapo_overlong_penalty(jnp.asarray([1]), max_len=10, cache_len=20)
  with pytest.raises(ValueError, match="cache_len"):
    dapo_overlong_penalty(jnp.asarray([1]), max_len=10, cache_len=0)
