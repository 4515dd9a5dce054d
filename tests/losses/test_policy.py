"""Policy objectives: float64 numpy references, hand-computed examples, clipping gradients, safety."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import _policy
from jaxrl.losses._aggregate import loss_weights
from jaxrl.losses._policy import OBJECTIVES, prox_logprobs_loglinear, register_objective

B, T = 4, 8


def _batch(seed, spread=0.4):
  rng = np.random.default_rng(seed)
  lp = -rng.uniform(0.05, 3.0, (B, T))
  old = np.minimum(lp + rng.normal(0.0, spread, (B, T)), -1e-3)
  prox = np.minimum(lp + rng.normal(0.0, spread, (B, T)), -1e-3)
  adv = rng.normal(0.0, 1.0, (B, T))
  adv[1] = adv[1, 0]  # one row with a sequence-level advantage
  mask = (rng.uniform(size=(B, T)) > 0.25).astype(np.float64)
  mask[:, 0] = 1.0
  w = mask / mask.sum()
  return dict(lp=lp, old=old, prox=prox, adv=adv, mask=mask, w=w)


def _call(name, d, **options):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return OBJECTIVES[name](logprobs=f32(d["lp"]), old_logprobs=f32(d["old"]), advantages=f32(d["adv"]),
                          loss_weights=f32(d["w"]), **options)


def _grad(name, d, **options):
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def f(lp):
    return OBJECTIVES[name](logprobs=lp, old_logprobs=f32(d["old"]), advantages=f32(d["adv"]),
                            loss_weights=f32(d["w"]), **options)[0]

  return np.asarray(jax.grad(f)(f32(d["lp"])))


# ------------------------------------------------------------------------------------------------
# Independent float64 numpy references (per-token loss ℓ; loss = Σ w ℓ).


def _np_ratio(a, b):
  return np.exp(np.clip(a - b, -20, 20))


def _np_clip_loss(r, adv, lo, hi):
  return np.maximum(-adv * r, -adv * np.clip(r, lo, hi))


def _np_seq_mean(x, mask):
  n = mask.sum(-1, keepdims=True)
  return np.where(n > 0, (x * mask).sum(-1, keepdims=True) / np.maximum(n, 1), 0.0)


def _np_cov(d):
  m = d["mask"] > 0
  lp, adv = d["lp"], d["adv"]
  return np.where(m, (lp - lp[m].mean()) * (adv - adv[m].mean()), 0.0)


def _np_topk(scores, eligible, k):
  flat_idx = np.flatnonzero(eligible.reshape(-1))
  order = flat_idx[np.argsort(-scores.reshape(-1)[flat_idx], kind="stable")]
  sel = np.zeros(scores.size, bool)
  sel[order[:k]] = True
  return sel.reshape(scores.shape)


def np_ppo_clip(d, epsilon=0.2):
  return _np_clip_loss(_np_ratio(d["lp"], d["old"]), d["adv"], 1 - epsilon, 1 + epsilon)


def np_clip_higher(d, epsilon_low=0.2, epsilon_high=0.28):
  return _np_clip_loss(_np_ratio(d["lp"], d["old"]), d["adv"], 1 - epsilon_low, 1 + epsilon_high)


def np_dual_clip(d, epsilon_low=0.2, epsilon_high=0.2, clip_ratio_c=3.0):
  l = _np_clip_loss(_np_ratio(d["lp"], d["old"]), d["adv"], 1 - epsilon_low, 1 + epsilon_high)
  return np.where(d["adv"] < 0, np.minimum(l, -clip_ratio_c * d["adv"]), l)


def np_decoupled_ppo(d, epsilon_low=0.2, epsilon_high=0.2):
  behav = np.exp(d["prox"] - d["old"])
  u = np.exp(d["lp"] - d["prox"])
  return behav * _np_clip_loss(u, d["adv"], 1 - epsilon_low, 1 + epsilon_high)


def np_vanilla_pg(d):
  return -d["adv"] * d["lp"]


def np_reinforce_is(d, ratio_cap=None):
  r = _np_ratio(d["lp"], d["old"])
  return -d["adv"] * (r if ratio_cap is None else np.minimum(r, ratio_cap))


def np_gpg(d):
  return -d["adv"] * d["lp"]


def np_gspo(d, epsilon_low=3e-4, epsilon_high=4e-4):
  s = np.exp(_np_seq_mean(d["lp"] - d["old"], d["mask"]))
  return _np_clip_loss(np.broadcast_to(s, d["lp"].shape), d["adv"], 1 - epsilon_low, 1 + epsilon_high)


def np_gmpo(d, epsilon_low=0.4, epsilon_high=0.4):
  lr, adv = d["lp"] - d["old"], d["adv"]
  sgn = np.sign(adv)
  lr_min = sgn * np.minimum(sgn * lr, sgn * np.clip(lr, -epsilon_low, epsilon_high))
  return -adv * np.exp(_np_seq_mean(lr_min, d["mask"]))


def np_cispo(d, epsilon_low=1.0, epsilon_high=4.0):
  r = _np_ratio(d["lp"], d["old"])
  return -np.clip(r, 1 - epsilon_low, 1 + epsilon_high) * d["adv"] * d["lp"]


def np_sapo(d, tau_pos=1.0, tau_neg=1.05):
  r = _np_ratio(d["lp"], d["old"])
  tau = np.where(d["adv"] > 0, tau_pos, tau_neg)
  return -d["adv"] * (4.0 / tau) / (1.0 + np.exp(-tau * (r - 1.0)))


def np_dppo_mask(d, divergence="binary_tv", delta_low=None, delta_high=None, ratio_cap=20.0):
  default = 0.15 if divergence == "binary_tv" else 0.05
  dl = default if delta_low is None else delta_low
  dh = default if delta_high is None else delta_high
  p, po = np.exp(d["lp"]), np.exp(d["old"])
  if divergence == "binary_tv":
    kp, kn = p - po <= dh, p - po >= -dl
  else:
    kl = po * np.log(po / p) + (1 - po) * np.log((1 - po + 1e-8) / (1 - p + 1e-8))
    kp, kn = (kl <= dh) | (p <= po), (kl <= dl) | (p >= po)
  keep = np.where(d["adv"] > 0, kp, kn)
  r = _np_ratio(d["lp"], d["old"])
  return np.where(keep, -d["adv"] * np.minimum(r, ratio_cap) * d["lp"], 0.0)


def np_clip_cov(d, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0):
  r = _np_ratio(d["lp"], d["old"])
  l = _np_clip_loss(r, d["adv"], 0.8, 1.2)
  clipped = ((d["adv"] < 0) & (r < 0.8)) | ((d["adv"] > 0) & (r > 1.2))
  cov = _np_cov(d)
  eligible = (d["mask"] > 0) & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
  k = max(int(math.floor(clip_cov_ratio * d["mask"].sum())), 1)
  return np.where(_np_topk(cov, eligible, k), 0.0, l)


def np_kl_cov(d, kl_cov_ratio=2e-4, ppo_kl_coef=1.0):
  r = _np_ratio(d["lp"], d["old"])
  cov = _np_cov(d)
  k = max(int(math.floor(kl_cov_ratio * d["mask"].sum())), 1)
  sel = _np_topk(cov, d["mask"] > 0, k)
  return -d["adv"] * r + np.where(sel, ppo_kl_coef * np.abs(d["lp"] - d["old"]), 0.0)


CASES = [
    ("ppo_clip", np_ppo_clip, {}),
    ("ppo_clip", np_ppo_clip, {"epsilon": 0.1}),
    ("clip_higher", np_clip_higher, {}),
    ("dual_clip", np_dual_clip, {"clip_ratio_c": 1.5}),
    ("decoupled_ppo", np_decoupled_ppo, {"epsilon_high": 0.28}),
    ("vanilla_pg", np_vanilla_pg, {}),
    ("reinforce_is", np_reinforce_is, {}),
    ("reinforce_is", np_reinforce_is, {"ratio_cap": 1.2}),
    ("gpg", np_gpg, {}),
    ("gspo", np_gspo, {}),
    ("gspo", np_gspo, {"epsilon_low": 0.05, "epsilon_high": 0.05}),
    ("gmpo", np_gmpo, {}),
    ("gmpo", np_gmpo, {"epsilon_low": 0.1, "epsilon_high": 0.2}),
    ("cispo", np_cispo, {}),
    ("cispo", np_cispo, {"epsilon_low": 0.2, "epsilon_high": 0.2}),
    ("sapo", np_sapo, {}),
    ("sapo", np_sapo, {"tau_pos": 2.0, "tau_neg": 4.0}),
    ("dppo_mask", np_dppo_mask, {}),
    ("dppo_mask", np_dppo_mask, {"divergence": "binary_kl", "ratio_cap": 1.5}),
    ("clip_cov", np_clip_cov, {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 10.0}),
    ("kl_cov", np_kl_cov, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 2.0}),
]


@pytest.mark.parametrize("name,ref,options", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_objective_matches_float64_numpy(name, ref, options, seed):
  d = _batch(seed)
  extra = {"prox_logprobs": jnp.asarray(d["prox"], jnp.float32)} if name == "decoupled_ppo" else {}
  loss, _ = _call(name, d, **options, **extra)
  expected = np.sum(d["w"] * d["mask"] * ref(d, **options))
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)


def test_every_listed_objective_is_registered():
  assert set(OBJECTIVES) >= {
      "ppo_clip", "clip_higher", "dual_clip", "decoupled_ppo", "vanilla_pg", "reinforce_is", "gpg", "gspo",
      "gmpo", "cispo", "sapo", "dppo_mask", "clip_cov", "kl_cov"}
  assert set(c[0] for c in CASES) == set(OBJECTIVES)


# ------------------------------------------------------------------------------------------------
# Gradients against analytic float64 gradients.


def _np_grad_ppo(d, lo, hi):
  r = _np_ratio(d["lp"], d["old"])
  adv = d["adv"]
  clipped = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
  return d["w"] * np.where(clipped, 0.0, -adv * r)


GRAD_CASES = {
    "ppo_clip": lambda d: _np_grad_ppo(d, 0.8, 1.2),
    "vanilla_pg": lambda d: -d["w"] * d["adv"],
    "reinforce_is": lambda d: -d["w"] * d["adv"] * _np_ratio(d["lp"], d["old"]),
    "cispo": lambda d: -d["w"] * d["adv"] * np.clip(_np_ratio(d["lp"], d["old"]), 0.0, 5.0),
    "sapo": lambda d: -d["w"] * d["adv"] * (lambda s, r: 4 * s * (1 - s) * r)(
        1 / (1 + np.exp(-np.where(d["adv"] > 0, 1.0, 1.05) * (_np_ratio(d["lp"], d["old"]) - 1))),
        _np_ratio(d["lp"], d["old"])),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradient_matches_analytic_float64(name):
  d = _batch(3)
  np.testing.assert_allclose(_grad(name, d), GRAD_CASES[name](d) * d["mask"], rtol=1e-5, atol=1e-7)


def test_gspo_token_form_gradient_is_sequence_ratio_times_score():
  d = _batch(4, spread=0.01)
  s = np.exp(_np_seq_mean(d["lp"] - d["old"], d["mask"]))
  lo, hi = 1 - 3e-4, 1 + 4e-4
  clipped = ((d["adv"] > 0) & (s > hi)) | ((d["adv"] < 0) & (s < lo))
  expected = d["w"] * np.where(clipped, 0.0, -d["adv"] * s) * d["mask"]
  np.testing.assert_allclose(_grad("gspo", d), expected, rtol=1e-5, atol=1e-7)


def test_gspo_equals_sequence_level_objective_under_seq_mean_token_mean():
  d = _batch(5, spread=0.02)
  d["adv"] = np.broadcast_to(d["adv"][:, :1], (B, T)).copy()
  n = d["mask"].sum(-1, keepdims=True)
  d["w"] = d["mask"] / n / B
  s = np.exp(_np_seq_mean(d["lp"] - d["old"], d["mask"]))[:, 0]
  a = d["adv"][:, 0]
  expected = -np.mean(np.minimum(s * a, np.clip(s, 1 - 0.02, 1 + 0.02) * a))
  loss, _ = _call("gspo", d, epsilon_low=0.02, epsilon_high=0.02)
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Hand-computed examples from the formulas.


def _hand(lp, old, adv):
  lp = np.log(np.asarray(lp, np.float64))
  old = np.log(np.asarray(old, np.float64))
  adv = np.asarray(adv, np.float64)
  n = lp.size
  return dict(lp=lp[None], old=old[None], adv=adv[None], mask=np.ones((1, n)), w=np.full((1, n), 1 / n))


def test_ppo_clip_hand_example():
  # r = [1.5, 1.1, 0.5, 0.9], A = [1, 1, -1, -1], ε = 0.2: ℓ = [-1.2, -1.1, 0.8, 0.9] → mean -0.15.
  d = _hand([0.6, 0.44, 0.2, 0.36], [0.4, 0.4, 0.4, 0.4], [1, 1, -1, -1])
  loss, metrics = _call("ppo_clip", d)
  np.testing.assert_allclose(float(loss), -0.15, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["clip_frac_high"]), 0.25, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["clip_frac_low"]), 0.25, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["ratio_max"]), 1.5, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["ratio_min"]), 0.5, rtol=1e-6)


def test_decoupled_ppo_hand_example_eq5():
  # π_prox/π_behav = 2, u = π_θ/π_prox = 1.5, A = 1, ε = 0.2: ℓ = -2·min(1.5, 1.2) = -2.4.
  d = _hand([0.6], [0.2], [1.0])
  loss, metrics = _call("decoupled_ppo", d, prox_logprobs=jnp.log(jnp.asarray([[0.4]])))
  np.testing.assert_allclose(float(loss), -2.4, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["behav_weight_mean"]), 2.0, rtol=1e-6)


def test_dual_clip_hand_example():
  # A = -1, r = 5, c = 3: clipped PPO loss max(5, 0.8) = 5 → dual clip min(5, 3) = 3.
  d = _hand([0.5], [0.1], [-1.0])
  loss, metrics = _call("dual_clip", d, clip_ratio_c=3.0)
  np.testing.assert_allclose(float(loss), 3.0, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["dual_clip_frac"]), 1.0, rtol=1e-6)


def test_dppo_tv_hand_example_masks_probability_jump():
  # p_old = 0.5, A > 0: p = 0.7 (Δp = 0.2 > δ = 0.15) is masked; p = 0.6 is kept: ℓ = -1.2·log 0.6.
  d = _hand([0.7, 0.6], [0.5, 0.5], [1.0, 1.0])
  loss, metrics = _call("dppo_mask", d)
  np.testing.assert_allclose(float(loss), 0.5 * (-1.2 * math.log(0.6)), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["clip_frac_high"]), 0.5, rtol=1e-6)


def test_loglinear_prox_hand_example():
  # v_θ = 8: v_behav = 3 → α = (7-3)/(8-3) = 0.8; v = 7 → 0; v = 8 → 0; v = -1 (prompt) → 0.
  lp = jnp.asarray([[-1.0, -1.0, -1.0, -1.0]])
  old = jnp.asarray([[-2.0, -2.0, -2.0, -2.0]])
  out = prox_logprobs_loglinear(lp, old, jnp.asarray([[3, 7, 8, -1]]), current_version=8)
  np.testing.assert_allclose(np.asarray(out), [[-2.0 + 0.8, -2.0, -2.0, -2.0]], rtol=1e-6)


def test_loglinear_prox_matches_float64_numpy():
  rng = np.random.default_rng(7)
  lp, old = -rng.uniform(0, 3, (B, T)), -rng.uniform(0, 3, (B, T))
  v = rng.integers(-1, 10, (B, T))
  cur = 10
  diff, gap = cur - v, cur - 1 - v
  alpha = np.where((diff > 0) & (v >= 0), gap / np.where(diff > 0, diff, 1), 0.0).clip(0, 1)
  out = prox_logprobs_loglinear(jnp.asarray(lp, jnp.float32), jnp.asarray(old, jnp.float32), jnp.asarray(v),
                                current_version=cur)
  np.testing.assert_allclose(np.asarray(out), old + alpha * (lp - old), rtol=1e-6, atol=1e-6)


def test_decoupled_ppo_from_versions_uses_loglinear_prox():
  d = _batch(8)
  v = np.random.default_rng(8).integers(0, 5, (B, T))
  prox = prox_logprobs_loglinear(jnp.asarray(d["lp"], jnp.float32), jnp.asarray(d["old"], jnp.float32),
                                 jnp.asarray(v), current_version=5)
  a, _ = _call("decoupled_ppo", d, versions=jnp.asarray(v), current_version=5)
  b, _ = _call("decoupled_ppo", d, prox_logprobs=prox)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)


def test_decoupled_ppo_without_prox_or_versions_raises():
  with pytest.raises(ValueError, match="prox_logprobs"):
    _call("decoupled_ppo", _batch(0))


# ------------------------------------------------------------------------------------------------
# Equivalences.


def test_decoupled_ppo_equals_ppo_clip_when_prox_is_behaviour():
  d = _batch(9)
  a, ma = _call("decoupled_ppo", d, prox_logprobs=jnp.asarray(d["old"], jnp.float32), epsilon_low=0.2,
                epsilon_high=0.2)
  b, mb = _call("ppo_clip", d, epsilon=0.2)
  assert float(a) == float(b)
  np.testing.assert_array_equal(_grad("decoupled_ppo", d, prox_logprobs=jnp.asarray(d["old"], jnp.float32)),
                                _grad("ppo_clip", d))
  assert float(ma["clip_frac"]) == float(mb["clip_frac"])


def test_decoupled_ppo_equals_ppo_clip_when_versions_are_one_step_stale():
  d = _batch(10)
  v = jnp.full((B, T), 6)
  a, _ = _call("decoupled_ppo", d, versions=v, current_version=7)
  b, _ = _call("ppo_clip", d)
  assert float(a) == float(b)


def test_clip_higher_with_equal_epsilons_equals_ppo_clip():
  d = _batch(11)
  a, _ = _call("clip_higher", d, epsilon_low=0.15, epsilon_high=0.15)
  b, _ = _call("ppo_clip", d, epsilon=0.15)
  assert float(a) == float(b)
  np.testing.assert_array_equal(_grad("clip_higher", d, epsilon_low=0.15, epsilon_high=0.15),
                                _grad("ppo_clip", d, epsilon=0.15))


def test_gpg_with_alpha_one_equals_vanilla_pg():
  d = _batch(12)
  assert float(_call("gpg", d)[0]) == float(_call("vanilla_pg", d)[0])


def test_is_weights_multiply_per_token_loss():
  d = _batch(13)
  isw = np.random.default_rng(13).uniform(0, 2, (B, T))
  loss, _ = _call("ppo_clip", d, is_weights=jnp.asarray(isw, jnp.float32))
  np.testing.assert_allclose(float(loss), np.sum(d["w"] * isw * np_ppo_clip(d)), rtol=1e-5)


def test_packed_segments_equal_rows_for_gspo():
  d = _batch(14, spread=0.05)
  d["mask"] = np.ones((B, T))
  d["w"] = d["mask"] / d["mask"].sum()
  loss_rows, _ = _call("gspo", d, epsilon_low=0.02, epsilon_high=0.02)
  packed = {k: v.reshape(B // 2, 2 * T) for k, v in d.items()}
  seg = jnp.asarray(np.repeat([[1] * T + [2] * T], B // 2, axis=0))
  loss_packed, _ = _call("gspo", packed, epsilon_low=0.02, epsilon_high=0.02, segment_ids=seg)
  np.testing.assert_allclose(float(loss_packed), float(loss_rows), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Gradients are exactly zero where the formula clips.


def _clip_batch():
  # Tokens: [A>0 r=1.5 (high clip), A>0 r=1.1, A<0 r=0.5 (low clip), A<0 r=0.9, A<0 r=5 (dual clip)].
  return _hand([0.6, 0.44, 0.2, 0.36, 0.5], [0.4, 0.4, 0.4, 0.4, 0.1], [1, 1, -1, -1, -1])


@pytest.mark.parametrize("name,options,zero,nonzero", [
    ("ppo_clip", {}, [0, 2], [1, 3, 4]),
    ("clip_higher", {"epsilon_low": 0.2, "epsilon_high": 0.28}, [0, 2], [1, 3, 4]),
    ("clip_higher", {"epsilon_low": 0.2, "epsilon_high": 0.6}, [2], [0, 1, 3, 4]),
    ("dual_clip", {"clip_ratio_c": 3.0}, [0, 2, 4], [1, 3]),
    ("gmpo", {"epsilon_low": 0.2, "epsilon_high": 0.2}, [0, 2], [1, 3, 4]),
    ("dppo_mask", {"delta_low": 0.15, "delta_high": 0.15}, [0, 2], [1, 3, 4]),
])
def test_gradient_is_exactly_zero_on_clipped_tokens(name, options, zero, nonzero):
  d = _clip_batch()
  g = _grad(name, d, **options)[0]
  assert np.all(g[zero] == 0.0), g
  assert np.all(g[nonzero] != 0.0), g


def test_decoupled_ppo_gradient_is_zero_where_u_is_clipped():
  d = _clip_batch()
  prox = jnp.asarray(d["old"], jnp.float32) + jnp.log(2.0)  # u = r/2: [0.75, 0.55, 0.25, 0.45, 2.5]
  g = _grad("decoupled_ppo", d, prox_logprobs=prox)[0]
  assert g[0] != 0 and g[1] != 0 and g[4] != 0  # A>0 with u < 1.2, A<0 with u > 0.8: unclipped
  assert g[2] == 0 and g[3] == 0  # A<0 with u < 0.8: clipped


def test_clip_cov_selected_tokens_have_zero_gradient():
  d = _batch(15, spread=0.05)
  opts = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 100.0}
  g = _grad("clip_cov", d, **opts)
  g_ppo = _grad("ppo_clip", d)
  selected = (g == 0) & (g_ppo != 0)
  k = int(math.floor(0.2 * d["mask"].sum()))
  assert selected.sum() == k
  np.testing.assert_array_equal(g[~selected], g_ppo[~selected])
  _, metrics = _call("clip_cov", d, **opts)
  np.testing.assert_allclose(float(metrics["cov_selected_frac"]), k / d["mask"].sum(), rtol=1e-6)


def test_clip_cov_random_choice_is_seeded_and_sized():
  d = _batch(16, spread=0.05)
  opts = {"clip_cov_ratio": 0.2, "clip_cov_lb": -100.0, "clip_cov_ub": 100.0}
  g_ppo = _grad("ppo_clip", d)
  k = int(math.floor(0.2 * d["mask"].sum()))
  picks = []
  for seed in (0, 0, 1):
    g = _grad("clip_cov", d, rng=jax.random.key(seed), **opts)
    sel = (g == 0) & (g_ppo != 0)
    assert sel.sum() == k
    picks.append(sel)
  np.testing.assert_array_equal(picks[0], picks[1])
  assert (picks[0] != picks[2]).any(), "another seed must pick another set of tokens"


def test_dual_clip_loss_for_negative_advantages_is_bounded_by_c_abs_a():
  rng = np.random.default_rng(17)
  c = 2.5
  lp = jnp.asarray(rng.uniform(-5, 0, (64, 16)), jnp.float32)
  old = lp - jnp.asarray(rng.uniform(-1, 4, (64, 16)), jnp.float32)  # ratios up to e^4
  adv = -jnp.asarray(rng.uniform(0.1, 3, (64, 16)), jnp.float32)
  for i in range(16):
    w = jnp.zeros((64, 16)).at[:, i].set(1.0)  # isolate one column: loss = Σ_b ℓ_{b,i}
    loss, _ = OBJECTIVES["dual_clip"](logprobs=lp, old_logprobs=old, advantages=adv, loss_weights=w,
                                      clip_ratio_c=c)
    assert float(loss) <= float(jnp.sum(c * jnp.abs(adv[:, i]))) * (1 + 1e-6)
  per_token = jnp.maximum(-adv * jnp.exp(lp - old), -adv * jnp.clip(jnp.exp(lp - old), 0.8, 1.2))
  assert bool(jnp.any(per_token > c * jnp.abs(adv)))  # the bound is active somewhere


# ------------------------------------------------------------------------------------------------
# Numerical safety and jit.


def _options(name):
  return {"decoupled_ppo": {"versions": jnp.zeros((B, T), jnp.int32), "current_version": 2},
          "clip_cov": {"clip_cov_lb": -1e9, "clip_cov_ub": 1e9}}.get(name, {})


def _all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def _run_eager(name, lp, old, adv, w):
  def f(x):
    return OBJECTIVES[name](logprobs=x, old_logprobs=old, advantages=adv, loss_weights=w, **_options(name))

  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(lp)
  return loss, metrics, g


_JITTED = {}


def _run(name, lp, old, adv, w):
  """Loss, metrics and gradient, jitted once per objective (the safety tests share shapes)."""
  if name not in _JITTED:
    _JITTED[name] = jax.jit(functools.partial(_run_eager, name))
  return _JITTED[name](lp, old, adv, w)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_empty_mask_gives_zero_loss_and_finite_gradient(name):
  d = _batch(18)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  lp = f32(d["lp"]).at[0, 0].set(-jnp.inf)
  loss, metrics, g = _run(name, lp, f32(d["old"]), f32(d["adv"]), jnp.zeros((B, T)))
  assert float(loss) == 0.0
  assert _all_finite((metrics, g)) and bool(jnp.all(g == 0))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("shift", [50.0, -50.0])
def test_ratio_overflow_stays_finite(name, shift):
  d = _batch(19)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  lp = f32(d["lp"]).at[:, ::2].add(shift)
  loss, metrics, g = _run(name, lp, f32(d["old"]), f32(d["adv"]), f32(d["w"]))
  assert _all_finite((loss, metrics, g))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_zero_advantages_give_finite_loss_and_no_policy_gradient_signal(name):
  d = _batch(20)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, metrics, g = _run(name, f32(d["lp"]), f32(d["old"]), jnp.zeros((B, T)), f32(d["w"]))
  assert _all_finite((loss, metrics, g))
  if name != "kl_cov":  # KL-Cov adds β|log r| on its selected tokens regardless of A
    assert float(loss) == 0.0 and bool(jnp.all(g == 0))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_single_sample_groups_and_masked_nan_padding_are_finite(name):
  d = _batch(21)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  w = loss_weights(f32(d["mask"]), mode="prompt_mean", group_ids=jnp.arange(B), num_groups=B)
  pad = f32(d["mask"]) == 0
  lp = jnp.where(pad, -jnp.inf, f32(d["lp"]))
  old = jnp.where(pad, jnp.nan, f32(d["old"]))
  loss, metrics, g = _run(name, lp, old, jnp.where(pad, jnp.nan, f32(d["adv"])), w)
  assert _all_finite((loss, metrics, g))
  assert bool(jnp.all(jnp.where(pad, g, 0.0) == 0))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_is_jit_safe(name):
  d = _batch(22)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  args = (f32(d["lp"]), f32(d["old"]), f32(d["adv"]), f32(d["w"]))
  eager = _run_eager(name, *args)
  jitted = _run(name, *args)
  np.testing.assert_allclose(float(jitted[0]), float(eager[0]), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(jitted[2]), np.asarray(eager[2]), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Registry and signature.


def test_register_objective_adds_and_refuses_duplicates():
  name = "test_only_negated_pg"
  try:
    @register_objective(name)
    def neg_pg(*, logprobs, old_logprobs, advantages, loss_weights, **context):
      return jnp.sum(loss_weights * advantages * logprobs), {}

    assert OBJECTIVES[name] is neg_pg
    with pytest.raises(ValueError, match="already registered"):
      register_objective(name, neg_pg)
    register_objective(name, neg_pg, overwrite=True)
  finally:
    OBJECTIVES.pop(name, None)


def test_unknown_option_raises_type_error():
  with pytest.raises(TypeError, match="epsilon_hgh"):
    _call("clip_higher", _batch(0), epsilon_hgh=0.3)


def test_objectives_are_keyword_only():
  d = _batch(0)
  with pytest.raises(TypeError):
    _policy.ppo_clip(d["lp"], d["old"], d["adv"], d["w"])


def test_metrics_are_weighted_sums():
  d = _batch(23)
  _, m = _call("ppo_clip", d)
  r = _np_ratio(d["lp"], d["old"])
  np.testing.assert_allclose(float(m["ratio_mean"]), np.sum(d["w"] * r), rtol=1e-5)
  np.testing.assert_allclose(float(m["approx_kl"]), np.sum(d["w"] * (r - 1 - np.log(r))), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(float(m["weight_sum"]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(m["ratio_max"]), r[d["mask"] > 0].max(), rtol=1e-6)
