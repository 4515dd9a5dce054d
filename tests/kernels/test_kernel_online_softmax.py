"""The shared online-softmax step (``_online_softmax.py``): tile by tile equals a float64 softmax."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels import _online_softmax
from jaxrl.kernels._common import EMPTY_LSE, LOG2E
from jaxrl.kernels._reference import MASK_VALUE

R, S, H, TILE = 6, 80, 8, 16


def problem(seed):
  """Logits ``[R, S]`` with a ragged mask (row 0 sees nothing, row 1 one key) and values ``[S, H]``."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(scale=4.0, size=(R, S))
  valid = rng.random((R, S)) < 0.6
  valid[0] = False
  valid[1] = False
  valid[1, 41] = True
  v = rng.normal(size=(S, H))
  return logits, valid, v


def float64_softmax(logits, valid, v):
  """``(o [R, H], lse [R])`` in float64; rows with no visible key get ``o = 0`` and ``lse = nan``."""
  x = np.where(valid, logits, -np.inf)
  m = np.max(x, axis=1, keepdims=True)
  e = np.where(valid, np.exp(x - np.where(np.isfinite(m), m, 0.0)), 0.0)
  l = e.sum(axis=1, keepdims=True)
  with np.errstate(invalid="ignore", divide="ignore"):
    o = np.where(l > 0, e @ v / np.where(l > 0, l, 1.0), 0.0)
    lse = np.where(l[:, 0] > 0, (m + np.log(l))[:, 0], np.nan)
  return o, lse


@pytest.mark.parametrize("column", [False, True], ids=["triton_layout", "tpu_layout"])
@pytest.mark.parametrize("base2", [False, True], ids=["exp", "exp2"])
def test_tiled_updates_equal_the_float64_softmax(column, base2):
  logits, valid, v = problem(0)
  scale = LOG2E if base2 else 1.0
  s_all = jnp.where(jnp.asarray(valid), jnp.asarray(logits * scale, jnp.float32), MASK_VALUE)
  m, l, acc = _online_softmax.init((R, H), column=column)
  for j in range(0, S, TILE):
    tile = slice(j, j + TILE)
    m, l, acc = _online_softmax.update(m, l, acc, s_all[:, tile], jnp.asarray(v[tile], jnp.float32),
                                       valid=jnp.asarray(valid[:, tile]), base2=base2)
  o, lse = _online_softmax.finish(m, l, acc, base2=base2, empty_lse=EMPTY_LSE)
  want_o, want_lse = float64_softmax(logits, valid, v)
  assert o.shape == (R, H) and o.dtype == jnp.float32
  lse = np.asarray(lse).reshape(R)
  np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse[1:], want_lse[1:], rtol=1e-6, atol=1e-5)
  assert np.all(np.asarray(o)[0] == 0.0) and lse[0] == np.float32(EMPTY_LSE)
