"""GKD's generalised JSD against TRL 0.19.1's recorded ``GKDTrainer.generalized_jsd_loss`` (values and gradients
w.r.t. the student logits, tests/fixtures/make_preference_fixtures.py) and float64 numpy; the chunked
hidden-state form against the logits form; the reverse-KL advantage against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from jaxrl import losses



def _np_jsd(s, t, beta, temp):
  """Float64 per-position JSD from TRL's definition (F.kl_div(input, target) = KL(target‖input))."""
  def log_softmax(z):
    z = z / temp
    return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
  s, t = log_softmax(s), log_softmax(t)
  kl = lambda p, q: np.sum(np.exp(p) * (p - q), -1)  # noqa: E731
  if beta == 0.0:
    return kl(t, s)
  if beta == 1.0:
    return kl(s, t)
  m = np.logaddexp(s + np.log(1 - beta), t + np.log(beta))
  return beta * kl(t, m) + (1 - beta) * kl(s, m)


def _ours(student, teacher, mask, beta, temp):
  fn = lambda s: losses.generalized_jsd_loss(s, jnp.asarray(teacher), jnp.asarray(mask), beta=beta,  # noqa: E731
                                             temperature=temp)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(student))
  return np.asarray(loss), np.asarray(grad)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_matches_trl_gkd(trl, beta):
  s, t, labels = trl["gkd/student"], trl["gkd/teacher"], trl["gkd/labels"]
  temp = float(trl["gkd/temperature"])
  assert temp != 1.0
  with enable_x64():
    loss, grad = _ours(s, t, labels != -100, beta, temp)
  np.testing.assert_allclose(loss, trl[f"gkd_{beta}/loss"], rtol=1e-5)
  np.testing.assert_allclose(grad, trl[f"gkd_{beta}/grad_student"], rtol=1e-5, atol=1e-12)
  loss32, grad32 = _ours(s.astype(np.float32), t.astype(np.float32), labels != -100, beta, temp)  # compute dtype
  np.testing.assert_allclose(loss32, trl[f"gkd_{beta}/loss"], rtol=1e-5)
  np.testing.assert_allclose(grad32, trl[f"gkd_{beta}/grad_student"], rtol=1e-4, atol=1e-6)


def test_beta_endpoints_are_forward_and_reverse_kl():
  rng = np.random.default_rng(0)
  s, t = rng.normal(0, 2, (3, 7)), rng.normal(0, 2, (3, 7))
  with enable_x64():
    fwd = np.asarray(losses.generalized_jsd(jnp.asarray(s), jnp.asarray(t), beta=0.0, temperature=0.7))
    rev = np.asarray(losses.generalized_jsd(jnp.asarray(s), jnp.asarray(t), beta=1.0, temperature=0.7))
    mid = np.asarray(losses.generalized_jsd(jnp.asarray(s), jnp.asarray(t), beta=0.3, temperature=0.7))
  ps, pt = (np.exp(x / 0.7) / np.exp(x / 0.7).sum(-1, keepdims=True) for x in (s, t))
  np.testing.assert_allclose(fwd, np.sum(pt * np.log(pt / ps), -1), rtol=1e-10)  # KL(T‖S)
  np.testing.assert_allclose(rev, np.sum(ps * np.log(ps / pt), -1), rtol=1e-10)  # KL(S‖T)
  pm = 0.3 * pt + 0.7 * ps
  np.testing.assert_allclose(mid, 0.3 * np.sum(pt * np.log(pt / pm), -1) + 0.7 * np.sum(ps * np.log(ps / pm), -1),
                             rtol=1e-10)
  assert np.all(mid <= -(0.3 * np.log(0.3) + 0.7 * np.log(0.7)) + 1e-12)  # bounded by the binary entropy H(β)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_modes_and_masked_nan(mode):
  rng = np.random.default_rng(1)
  s, t = rng.normal(0, 1, (3, 6, 9)), rng.normal(0, 1, (3, 6, 9))
  mask = rng.random((3, 6)) < 0.6
  mask[0, :] = False  # an empty row
  s_bad = s.copy()
  s_bad[~mask] = np.nan  # masked positions never reach the loss
  with enable_x64():
    loss, _ = losses.generalized_jsd_loss(jnp.asarray(s_bad), jnp.asarray(t), jnp.asarray(mask), beta=0.5,
                                          temperature=1.3, mode=mode)
  tok = _np_jsd(s, t, 0.5, 1.3)
  m = mask.astype(np.float64)
  if mode == "token_mean":
    want = np.sum(tok * m) / m.sum()
  else:
    rows = m.sum(-1) > 0
    per = np.sum(tok * m, -1) / (np.maximum(m.sum(-1), 1) if mode == "seq_mean_token_mean" else 1.0)
    want = per[rows].sum() / rows.sum()
  np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-6)  # the weights 1/N are float32


def test_chunked_hidden_form_equals_logits_form():
  """Teacher wider than the student (D' = 24 vs D = 16), several chunks with padding: same values and grads."""
  rng = np.random.default_rng(2)
  hs, ws = rng.normal(0, 1, (2, 5, 16)), rng.normal(0, 0.5, (16, 33))
  ht, wt = rng.normal(0, 1, (2, 5, 24)), rng.normal(0, 0.5, (24, 33))
  g = rng.normal(0, 1, (2, 5))
  want = _np_jsd(hs @ ws, ht @ wt, 0.4, 0.8)
  with enable_x64():
    hs, ws, ht, wt, g = map(jnp.asarray, (hs, ws, ht, wt, g))
    chunked = lambda h, w: jnp.sum(g * losses.token_generalized_jsd(  # noqa: E731
        h, w, ht, wt, beta=0.4, temperature=0.8, chunk_size=3))
    full = lambda h, w: jnp.sum(g * losses.generalized_jsd(h @ w, ht @ wt, beta=0.4, temperature=0.8))  # noqa: E731
    v1, g1 = jax.value_and_grad(chunked, argnums=(0, 1))(hs, ws)
    v2, g2 = jax.value_and_grad(full, argnums=(0, 1))(hs, ws)
    per = losses.token_generalized_jsd(hs, ws, ht, wt, beta=0.4, temperature=0.8, chunk_size=3)
  np.testing.assert_allclose(np.asarray(per), want, rtol=1e-10)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-12)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-14)


def test_reverse_kl_advantages():
  rng = np.random.default_rng(3)
  s, t = -rng.uniform(0, 5, (4, 7)), -rng.uniform(0, 5, (4, 7))
  mask = rng.random((4, 7)) < 0.7
  adv = np.asarray(losses.reverse_kl_advantages(s, t, mask, coef=0.5))
  np.testing.assert_allclose(adv, np.where(mask, -0.5 * (s - t), 0.0), rtol=1e-6)
  assert np.all(np.asarray(losses.reverse_kl_advantages(s, s, mask)) == 0.0)


@pytest.mark.parametrize("bad", [dict(beta=-0.1), dict(beta=1.5), dict(temperature=0.0)])
def test_bad_options_refused(bad):
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="generalized_jsd"):
    losses.generalized_jsd(x, x, **bad)
