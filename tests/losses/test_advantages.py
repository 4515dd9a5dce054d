"""Advantage estimators against float64 numpy references, hand-computed examples and shard_map."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.losses import _advantages as adv_lib
from jaxrl.sharding import make_mesh

TOL = dict(rtol=1e-5, atol=1e-5)
EPS = 1e-6
GROUP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
T = 7

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "maxrl", "seed_grpo",
                    "arpo_hard", "arpo_soft")


# --------------------------------------------------------------------------------------------------
# Random inputs.


def _batch(seed, *, binary=False, t=T, sizes=GROUP_SIZES):
  """Groups of the given sizes in shuffled row order, right-padded masks (some empty)."""
  rng = np.random.default_rng(seed)
  gid = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)])
  perm = rng.permutation(len(gid))
  gid = gid[perm]
  b = len(gid)
  if binary:
    rewards = rng.integers(0, 2, b).astype(np.float64)
  else:
    rewards = np.round(rng.normal(size=b), 3)
  rewards[gid == 3] = 0.7  # one group with equal rewards
  lengths = rng.integers(1, t + 1, b)
  lengths[rng.choice(b, 3, replace=False)] = 0  # empty responses
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
  return rewards, gid, mask


def _tree(gid, mask, seed):
  """prefix_ids: in each group, member j shares its first d_j tokens with the group's first member."""
  rng = np.random.default_rng(seed)
  pid = -np.ones(mask.shape, np.int64)
  lengths = mask.sum(1).astype(int)
  next_id = 0
  for g in np.unique(gid):
    ms = np.flatnonzero(gid == g)
    if len(ms) < 2:
      continue
    root = ms[0]
    depth = {j: rng.integers(0, min(lengths[j], lengths[root]) + 1) for j in ms[1:]}
    for t in range(lengths[root]):
      sharers = [j for j in ms[1:] if depth[j] > t]
      if sharers:
        for j in [root, *sharers]:
          pid[j, t] = next_id
        next_id += 1
  return pid


def _case(name, seed):
  """(array kwargs, static kwargs) for one registry estimator."""
  binary = name in ("grpo_passk", "maxrl", "gpg")
  r, g, m = _batch(seed, binary=binary)
  rng = np.random.default_rng(seed + 100)
  arrays = dict(rewards=r, group_ids=g, response_mask=m)
  static = {}
  if name == "remax":
    arrays["baseline_rewards"] = np.round(rng.normal(size=len(r)), 3)
  elif name in ("gae", "egae"):
    arrays["values"] = rng.normal(size=m.shape)
    arrays["token_rewards"] = 0.1 * rng.normal(size=m.shape)
    static.update(gamma=0.9, lam=0.8)
    if name == "egae":
      arrays["finished"] = rng.integers(0, 2, len(r)).astype(bool)
      arrays["bootstrap_values"] = rng.normal(size=len(r))
  elif name == "seed_grpo":
    arrays["cluster_ids"] = rng.integers(0, 3, len(r))
    static["num_clusters"] = 3
  elif name in ("arpo_hard", "arpo_soft"):
    arrays["prefix_ids"] = _tree(g, m, seed)
  elif name == "grpo_passk":
    static["k"] = 2
  return arrays, static


def _jnp(arrays):
  out = {}
  for k, v in arrays.items():
    if isinstance(v, adv_lib.Moments):
      out[k] = v
      continue
    v = np.asarray(v)
    out[k] = jnp.asarray(v, jnp.int32 if v.dtype.kind in "iu" else (bool if v.dtype == bool else jnp.float32))
  return out


def _run(name, arrays, **static):
  """Runs a registry estimator eagerly, returns float64 numpy outputs."""
  adv, metrics = adv_lib.ADVANTAGES[name](**_jnp(arrays), **static)
  return np.asarray(adv, np.float64), {k: float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------
# float64 numpy references (loops allowed here).


def _members(gid, valid, i):
  return np.flatnonzero((gid == gid[i]) & valid)


def _degenerate(x):
  return len(x) < 2 or np.all(x == x[0])


def _bcast(seq, mask):
  return np.where(mask > 0, seq[:, None], 0.0)


def ref_grpo(r, gid, mask, *, mean_level="group", std_level="group", std_normalize=True, eps=EPS,
             unbiased=False, valid=None):
  valid = mask.any(1) if valid is None else valid
  if not std_normalize:
    std_level = "none"
  ddof = 1 if unbiased else 0
  batch = r[valid]
  out = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    grp = r[_members(gid, valid, i)]
    zero = False
    if mean_level == "group":
      mu = grp.mean()
      zero |= _degenerate(grp)
    elif mean_level == "batch":
      mu = batch.mean()
      zero |= std_level == "none" and _degenerate(batch)
    else:
      mu = 0.0
    if std_level == "none":
      a = r[i] - mu
    else:
      ref = grp if std_level == "group" else batch
      zero |= _degenerate(ref)
      a = (r[i] - mu) / (np.std(ref, ddof=ddof) + eps) if not zero else 0.0
    out[i] = 0.0 if zero else a
  return out


def ref_rloo(r, gid, mask):
  valid = mask.any(1)
  out = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    ms = _members(gid, valid, i)
    if not _degenerate(r[ms]):
      out[i] = r[i] - (r[ms].sum() - r[i]) / (len(ms) - 1)
  return out


def ref_opo(r, gid, mask):
  valid = mask.any(1)
  lengths = mask.sum(1)
  out = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    ms = _members(gid, valid, i)
    if not _degenerate(r[ms]):
      out[i] = r[i] - (lengths[ms] * r[ms]).sum() / lengths[ms].sum()
  return out


def ref_gpg(r, gid, mask, min_ratio=0.05):
  valid = mask.any(1)
  out = np.zeros(len(r))
  n_bad = sum(_degenerate(r[_members(gid, valid, i)]) for i in np.flatnonzero(valid))
  alpha = 1.0 / max(1.0 - n_bad / valid.sum(), min_ratio)
  for i in np.flatnonzero(valid):
    grp = r[_members(gid, valid, i)]
    if not _degenerate(grp):
      out[i] = alpha * (r[i] - grp.mean())
  return out


def ref_passk(r, gid, mask, k, eps=EPS):
  valid = mask.any(1)
  out = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    grp = r[_members(gid, valid, i)]
    n, n_neg = len(grp), int((grp <= 0).sum())
    if n < k:
      continue
    mean = 1 - math.comb(n_neg, k) / math.comb(n, k)
    sigma = math.sqrt(mean * (1 - mean))
    if sigma == 0:
      continue
    if r[i] > 0:
      out[i] = (1 - mean) / (sigma + eps)
    else:
      out[i] = (1 - mean - math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1)) / (sigma + eps)
  return out


def ref_maxrl(r, gid, mask, eps=EPS):
  valid = mask.any(1)
  out = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    grp = r[_members(gid, valid, i)]
    if not _degenerate(grp) and grp.mean() > 0:
      out[i] = (r[i] - grp.mean()) / (grp.mean() + eps)
  return out


def ref_whiten(x, mask, eps=EPS):
  vals = x[mask > 0]
  if len(vals) == 0 or np.all(vals == vals[0]):
    return np.zeros_like(x)
  return np.where(mask > 0, (x - vals.mean()) / (vals.std() + eps), 0.0)


def ref_token_normalize(x, gid, mask, mean_level, std_level, eps=EPS):
  valid = mask.any(1)
  out = np.zeros_like(x)
  batch = x[mask > 0]
  for i in np.flatnonzero(valid):
    grp_rows = _members(gid, valid, i)
    grp = x[grp_rows][mask[grp_rows] > 0]
    for t in np.flatnonzero(mask[i] > 0):
      zero = False
      if mean_level == "group":
        mu, zero = grp.mean(), zero or _degenerate(grp)
      elif mean_level == "batch":
        mu, zero = batch.mean(), zero or (std_level == "none" and _degenerate(batch))
      else:
        mu = 0.0
      if std_level == "none":
        sd = None
      else:
        ref = grp if std_level == "group" else batch
        zero = zero or _degenerate(ref)
        sd = ref.std()
      out[i, t] = 0.0 if zero else ((x[i, t] - mu) if sd is None else (x[i, t] - mu) / (sd + eps))
  return out


def ref_returns(r, mask, gamma, token_rewards=None):
  out = np.zeros(mask.shape)
  for i in range(len(r)):
    idx = np.flatnonzero(mask[i] > 0)
    g = 0.0
    for j, t in enumerate(idx[::-1]):
      rt = (r[i] if j == 0 else 0.0) + (0.0 if token_rewards is None else token_rewards[i, t])
      g = rt + gamma * g
      out[i, t] = g
  return out


def ref_gae(r, mask, values, gamma, lam, token_rewards=None, finished=None, bootstrap=None):
  b = len(r)
  finished = np.ones(b, bool) if finished is None else finished
  adv = np.zeros(mask.shape)
  for i in range(b):
    idx = np.flatnonzero(mask[i] > 0)
    next_v = 0.0 if finished[i] else bootstrap[i]
    next_a = 0.0
    for j, t in enumerate(idx[::-1]):
      rt = (0.0 if token_rewards is None else token_rewards[i, t])
      if j == 0 and finished[i]:
        rt += r[i]
      delta = rt + gamma * next_v - values[i, t]
      next_a = delta + gamma * lam * next_a
      adv[i, t] = next_a
      next_v = values[i, t]
  return adv


def ref_seed(r, gid, mask, cluster, alpha, estimator):
  valid = mask.any(1)
  base = ref_grpo(r, gid, mask)
  out = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    ms = _members(gid, valid, i)
    n = len(ms)
    if n < 2:
      continue
    counts = np.array([np.sum(cluster[ms] == c) for c in np.unique(cluster[ms])], np.float64)
    p = counts / n
    se = -np.mean(np.log(p)) if estimator == "mc" else -np.sum(p * np.log(p))
    out[i] = base[i] * (1 - alpha * se / np.log(n))
  return out


def ref_arpo_hard(r, gid, mask, pid):
  tok = _bcast(ref_grpo(r, gid, mask), mask)
  valid = mask.any(1)
  out = tok.copy()
  for p in np.unique(pid[pid >= 0]):
    where = (pid == p) & (mask > 0) & valid[:, None]
    if where.any():
      out[where] = tok[where].mean()
  return out


# --------------------------------------------------------------------------------------------------
# GRPO and its variants.


@pytest.mark.parametrize("mean_level,std_level,unbiased", [
    ("group", "group", False), ("group", "group", True), ("group", "batch", False),
    ("batch", "batch", False), ("batch", "none", False), ("none", "group", False), ("none", "none", False)])
def test_grpo_matches_numpy_reference(mean_level, std_level, unbiased):
  r, g, m = _batch(0)
  got, _ = _run("grpo", dict(rewards=r, group_ids=g, response_mask=m), mean_level=mean_level,
                std_level=std_level, unbiased_std=unbiased)
  want = _bcast(ref_grpo(r, g, m, mean_level=mean_level, std_level=std_level, unbiased=unbiased), m)
  np.testing.assert_allclose(got, want, **TOL)


def test_grpo_hand_example_alignxplore():
  # A_i = (R_i - mean) / std over {3, 1, 2}: mean 2, std sqrt(2/3).
  arrays = dict(rewards=[3.0, 1.0, 2.0], group_ids=[0, 0, 0], response_mask=np.ones((3, 2)))
  got, metrics = _run("grpo", arrays, eps=0.0)
  s = math.sqrt(1.5)
  np.testing.assert_allclose(got, [[s, s], [-s, -s], [0.0, 0.0]], **TOL)
  assert metrics["degenerate_group_fraction"] == 0.0


def test_grpo_without_std_equals_dr_grpo():
  r, g, m = _batch(1)
  arrays = dict(rewards=r, group_ids=g, response_mask=m)
  got, _ = _run("grpo", arrays, std_normalize=False)
  dr, _ = _run("dr_grpo", arrays)
  valid = m.any(1)
  want = np.zeros(len(r))
  for i in np.flatnonzero(valid):
    want[i] = r[i] - r[_members(g, valid, i)].mean()
  np.testing.assert_allclose(got, _bcast(want, m), **TOL)
  np.testing.assert_array_equal(got, dr)


def test_grpo_plus_overlong_filter_keeps_truncated_response_in_baseline():
  # Row 3 was truncated: its mask is zeroed (GRPO+ overlong filtering) but it stays in the group
  # when sample_mask says so: mean 1/4, std sqrt(3)/4.
  r = [1.0, 0.0, 0.0, 0.0]
  m = np.ones((4, 3))
  m[3] = 0.0
  arrays = dict(rewards=r, group_ids=[0, 0, 0, 0], response_mask=m)
  got, _ = _run("grpo", {**arrays, "sample_mask": np.ones(4, bool)}, eps=0.0)
  np.testing.assert_allclose(got[:, 0], [math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), 0.0], **TOL)
  dropped, _ = _run("grpo", arrays, eps=0.0)  # default: the empty row takes no part
  np.testing.assert_allclose(dropped[:, 0], [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2), 0.0], **TOL)


def test_rloo_matches_reference_and_hand_example():
  r, g, m = _batch(2)
  got, _ = _run("rloo", dict(rewards=r, group_ids=g, response_mask=m))
  np.testing.assert_allclose(got, _bcast(ref_rloo(r, g, m), m), **TOL)
  hand, _ = _run("rloo", dict(rewards=[1.0, 0.0, 0.0, 0.0], group_ids=[0] * 4, response_mask=np.ones((4, 1))))
  np.testing.assert_allclose(hand[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3], **TOL)


def test_opo_matches_reference_and_length_weighted_hand_example():
  r, g, m = _batch(3)
  got, _ = _run("opo", dict(rewards=r, group_ids=g, response_mask=m))
  np.testing.assert_allclose(got, _bcast(ref_opo(r, g, m), m), **TOL)
  # lengths 1 and 3, rewards 1 and 0: b = (1·1 + 3·0) / 4.
  hand, _ = _run("opo", dict(rewards=[1.0, 0.0], group_ids=[0, 0], response_mask=[[1, 0, 0], [1, 1, 1]]))
  np.testing.assert_allclose(hand, [[0.75, 0, 0], [-0.25, -0.25, -0.25]], **TOL)


def test_gpg_matches_reference_and_rescales_by_valid_fraction():
  r, g, m = _batch(4, binary=True)
  got, _ = _run("gpg", dict(rewards=r, group_ids=g, response_mask=m))
  np.testing.assert_allclose(got, _bcast(ref_gpg(r, g, m), m), **TOL)
  # Group 0 {1, 0} is informative, group 1 {1, 1} is not: M/B = 1/2, alpha = 2.
  hand, metrics = _run("gpg", dict(rewards=[1.0, 0.0, 1.0, 1.0], group_ids=[0, 0, 1, 1],
                                   response_mask=np.ones((4, 1))))
  np.testing.assert_allclose(hand[:, 0], [1.0, -1.0, 0.0, 0.0], **TOL)
  assert metrics["gpg_alpha"] == 2.0


def test_grpo_passk_matches_reference_and_hand_example():
  r, g, m = _batch(5, binary=True)
  for k in (1, 2, 3):
    got, _ = _run("grpo_passk", dict(rewards=r, group_ids=g, response_mask=m), k=k)
    np.testing.assert_allclose(got, _bcast(ref_passk(r, g, m, k), m), **TOL)
  # N = 4, one correct, k = 2: R̄ = 1 - C(3,2)/C(4,2) = 1/2, σ = 1/2,
  # A_pos = (1/2)/(1/2) = 1, A_neg = (1/2 - C(2,1)/C(3,1))/(1/2) = -1/3.
  hand, metrics = _run("grpo_passk", dict(rewards=[1.0, 0.0, 0.0, 0.0], group_ids=[0] * 4,
                                          response_mask=np.ones((4, 1))), k=2, eps=0.0)
  np.testing.assert_allclose(hand[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3], **TOL)
  assert metrics["passk_mean"] == pytest.approx(0.5)


def test_grpo_passk_with_k1_equals_grpo_on_binary_rewards():
  r, g, m = _batch(6, binary=True)
  arrays = dict(rewards=r, group_ids=g, response_mask=m)
  np.testing.assert_allclose(_run("grpo_passk", arrays, k=1)[0], _run("grpo", arrays)[0], **TOL)


def test_maxrl_matches_reference_and_inverse_success_rate():
  r, g, m = _batch(7, binary=True)
  got, _ = _run("maxrl", dict(rewards=r, group_ids=g, response_mask=m))
  np.testing.assert_allclose(got, _bcast(ref_maxrl(r, g, m), m), **TOL)
  # K = 1 of N = 4 correct: (N - K)/K = 3 for the correct one, -1 for the others.
  arrays = dict(rewards=[1.0, 0.0, 0.0, 0.0], group_ids=[0] * 4, response_mask=np.ones((4, 1)))
  hand, _ = _run("maxrl", arrays, eps=0.0)
  np.testing.assert_allclose(hand[:, 0], [3.0, -1.0, -1.0, -1.0], **TOL)


def test_remax_subtracts_greedy_baseline_reward():
  arrays, _ = _case("remax", 8)
  got, _ = _run("remax", arrays)
  want = _bcast(arrays["rewards"] - arrays["baseline_rewards"], arrays["response_mask"])
  np.testing.assert_allclose(got, want, **TOL)


# --------------------------------------------------------------------------------------------------
# Token-level whitening.


def test_reinforce_pp_matches_reference_with_discount_and_token_rewards():
  r, g, m = _batch(9)
  tok = 0.1 * np.random.default_rng(9).normal(size=m.shape)
  got, _ = _run("reinforce_pp", dict(rewards=r, response_mask=m, token_rewards=tok), gamma=0.9)
  np.testing.assert_allclose(got, ref_whiten(ref_returns(r, m, 0.9, tok), m), **TOL)


def test_reinforce_pp_baseline_matches_reference():
  r, g, m = _batch(10)
  got, _ = _run("reinforce_pp_baseline", dict(rewards=r, group_ids=g, response_mask=m))
  centered = _bcast(ref_grpo(r, g, m, std_normalize=False), m)
  np.testing.assert_allclose(got, ref_whiten(centered, m), **TOL)


@pytest.mark.parametrize("mean_level,std_level", [("batch", "batch"), ("group", "batch"), ("group", "group"),
                                                  ("batch", "none")])
def test_global_normalize_matches_reference(mean_level, std_level):
  r, g, m = _batch(11)
  x = np.random.default_rng(11).normal(size=m.shape)
  got, _ = _run("global_normalize", dict(rewards=r, group_ids=g, response_mask=m, advantages=x),
                mean_level=mean_level, std_level=std_level)
  np.testing.assert_allclose(got, ref_token_normalize(x, g, m, mean_level, std_level), **TOL)


def test_global_normalize_hand_example_areal():
  # Rewards ±5 on responses of 1 and 3 tokens: token values [5, -5, -5, -5], mean -2.5,
  # std sqrt(18.75) = 2.5·sqrt(3); normalised: sqrt(3) and -1/sqrt(3).
  got, _ = _run("global_normalize", dict(rewards=[5.0, -5.0], response_mask=[[1, 0, 0], [1, 1, 1]]), eps=0.0)
  s = math.sqrt(3)
  np.testing.assert_allclose(got, [[s, 0, 0], [-1 / s, -1 / s, -1 / s]], **TOL)


def test_global_normalize_with_precomputed_moments_equals_whole_batch():
  r, g, m = _batch(12)
  x = np.random.default_rng(12).normal(size=m.shape)
  whole, _ = _run("global_normalize", dict(rewards=r, response_mask=m, advantages=x))
  half = len(r) // 2
  moments = [adv_lib.masked_moments(jnp.asarray(x[s], jnp.float32), jnp.asarray(m[s]))
             for s in (slice(0, half), slice(half, None))]
  total = moments[0].merge(moments[1])
  parts = []
  for s in (slice(0, half), slice(half, None)):
    arrays = dict(rewards=r[s], response_mask=m[s], advantages=x[s], global_moments=total)
    parts.append(_run("global_normalize", arrays)[0])
  np.testing.assert_allclose(np.concatenate(parts), whole, **TOL)


def test_merged_moments_match_numpy_when_the_mean_dwarfs_the_spread():
  # E[x²] - mean² loses the variance here in float32 (mean² ≈ 1e6 with ulp 0.06, var ≈ 1e-2).
  rng = np.random.default_rng(3)
  x = 1e3 + 0.1 * rng.normal(size=(6, 50))
  m = rng.integers(0, 2, size=x.shape).astype(np.float32)
  parts = [adv_lib.masked_moments(jnp.asarray(x[s], jnp.float32), jnp.asarray(m[s]))
           for s in (slice(0, 2), slice(2, 6))]
  merged = parts[0].merge(parts[1])
  valid = x[m > 0].astype(np.float32).astype(np.float64)
  assert float(merged.count) == valid.size
  np.testing.assert_allclose(float(merged.mean), valid.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(merged.variance()), valid.var(), rtol=1e-3)
  np.testing.assert_allclose(float(merged.variance(unbiased=True)), valid.var(ddof=1), rtol=1e-3)
  x32 = jnp.asarray(x[m > 0], jnp.float32)
  naive = float(jnp.mean(x32 * x32) - jnp.mean(x32) ** 2)
  assert abs(naive - valid.var()) > 0.1 * valid.var()  # the formula this replaces fails the same check


@pytest.mark.parametrize("name", ["global_normalize", "reinforce_pp", "reinforce_pp_baseline"])
def test_whitening_unbiased_std_is_the_ddof1_token_std(name):
  # verl's masked_whiten: (x - mean) / sqrt(var · n/(n-1) + 1e-8) over the valid tokens.
  r, g, m = _batch(5)
  arrays = dict(rewards=r, group_ids=g, response_mask=m)
  pop, _ = _run(name, arrays, eps=0.0)
  unb, _ = _run(name, arrays, eps=0.0, unbiased_std=True)
  n = m.sum()
  np.testing.assert_allclose(unb, pop * np.sqrt((n - 1) / n), **TOL)
  assert np.abs(pop).max() > 0.5


def test_global_normalize_needs_no_rewards_when_given_advantages():
  _, _, m = _batch(4)
  x = np.random.default_rng(4).normal(size=m.shape)
  got, _ = adv_lib.global_normalize(advantages=jnp.asarray(x, jnp.float32), response_mask=jnp.asarray(m))
  want = np.where(m > 0, (x - x[m > 0].mean()) / (x[m > 0].std() + 1e-6), 0.0)
  np.testing.assert_allclose(got, want, **TOL)
  with pytest.raises(ValueError, match="rewards or advantages"):
    adv_lib.global_normalize(response_mask=jnp.asarray(m))


# --------------------------------------------------------------------------------------------------
# GAE and EGAE.


def _holey_mask(seed, b=9, t=8):
  """Masks that end early, are empty, or have holes (e.g. tool output inside a response)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, t + 1, b)
  m = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
  m[rng.random(m.shape) < 0.15] = 0.0
  return m


def test_gae_matches_reference_with_holes_and_early_ends():
  m = _holey_mask(13)
  rng = np.random.default_rng(13)
  r, v, tok = rng.normal(size=m.shape[0]), rng.normal(size=m.shape), 0.1 * rng.normal(size=m.shape)
  arrays = dict(rewards=r, response_mask=m, values=v, token_rewards=tok)
  got, _ = _run("gae", arrays, gamma=0.95, lam=0.9)
  want = ref_gae(r, m, v, 0.95, 0.9, tok)
  np.testing.assert_allclose(got, want, **TOL)
  returns = np.asarray(adv_lib.gae_returns(**_jnp(arrays), gamma=0.95, lam=0.9))
  np.testing.assert_allclose(returns, np.where(m > 0, want + v, 0.0), **TOL)


def test_gae_hand_example():
  # γ = λ = 1: A_t = R - V(s_t); the padded 4th value is ignored.
  arrays = dict(rewards=[1.0], response_mask=[[1, 1, 1, 0]], values=[[1.0, 2.0, 3.0, 9.0]])
  got, _ = _run("gae", arrays)
  np.testing.assert_allclose(got, [[0.0, -1.0, -2.0, 0.0]], **TOL)
  np.testing.assert_allclose(adv_lib.gae_returns(**_jnp(arrays)), [[1.0, 1.0, 1.0, 0.0]], **TOL)


def test_egae_hand_example_bootstraps_at_window_end():
  # Unfinished window of ℓ = 2, V = [0.5, 0.25], V(s_ℓ) = 1, γ = λ = 0.5, no rewards yet:
  # δ_1 = 0.5·1 - 0.25 = 0.25, δ_0 = 0.5·0.25 - 0.5 = -0.375, Â_0 = δ_0 + 0.25·δ_1 = -0.3125.
  arrays = dict(rewards=[7.0], response_mask=[[1, 1]], values=[[0.5, 0.25]], finished=[False],
                bootstrap_values=[1.0])
  got, metrics = _run("egae", arrays, gamma=0.5, lam=0.5)
  np.testing.assert_allclose(got, [[-0.3125, 0.25]], **TOL)
  assert metrics["unfinished_fraction"] == 1.0


def test_egae_matches_reference():
  arrays, static = _case("egae", 14)
  got, _ = _run("egae", arrays, **static)
  want = ref_gae(arrays["rewards"], arrays["response_mask"], arrays["values"], static["gamma"], static["lam"],
                 arrays["token_rewards"], arrays["finished"], arrays["bootstrap_values"])
  np.testing.assert_allclose(got, want, **TOL)


def test_egae_window_plus_discounted_tail_equals_full_gae():
  rng = np.random.default_rng(15)
  b, t_full, window, gamma, lam = 6, 9, 5, 0.9, 0.8
  lengths = np.array([2, 5, 6, 9, 7, 0])
  m_full = (np.arange(t_full)[None, :] < lengths[:, None]).astype(np.float64)
  r, v = rng.normal(size=b), rng.normal(size=(b, t_full))
  full, _ = _run("gae", dict(rewards=r, response_mask=m_full, values=v), gamma=gamma, lam=lam)
  finished = lengths <= window
  win, _ = _run("egae", dict(rewards=r, response_mask=m_full[:, :window], values=v[:, :window],
                             finished=finished, bootstrap_values=v[:, window]), gamma=gamma, lam=lam)
  tail = (gamma * lam) ** (window - np.arange(window))[None, :] * full[:, window:window + 1]
  want = full[:, :window] - np.where(finished[:, None], 0.0, tail) * m_full[:, :window]
  np.testing.assert_allclose(win, want, **TOL)


# --------------------------------------------------------------------------------------------------
# SEED-GRPO and ARPO.


def test_seed_grpo_hand_example_semantic_entropy():
  # Clusters {0, 0, 1, 2} of N = 4: P = 1/2, 1/4, 1/4, SE_max = log 4.
  # MC: SE = -(1/3)(log 1/2 + 2 log 1/4) = (5/3) log 2 -> ratio 5/6; Shannon: 1.5 log 2 -> 3/4.
  arrays = dict(rewards=[1.0, 0.0, 0.0, 1.0], group_ids=[0] * 4, response_mask=np.ones((4, 1)),
                cluster_ids=[0, 0, 1, 2])
  mc, metrics = _run("seed_grpo", arrays, eps=0.0, num_clusters=3)
  np.testing.assert_allclose(mc[:, 0], np.array([1, -1, -1, 1]) / 6, **TOL)
  assert metrics["semantic_entropy_mean"] == pytest.approx(5 / 3 * math.log(2), rel=1e-6)
  shannon, _ = _run("seed_grpo", arrays, eps=0.0, num_clusters=3, estimator="shannon", alpha=0.5)
  np.testing.assert_allclose(shannon[:, 0], np.array([1, -1, -1, 1]) * (1 - 0.5 * 0.75), **TOL)


@pytest.mark.parametrize("estimator", ["mc", "shannon"])
def test_seed_grpo_matches_reference(estimator):
  arrays, static = _case("seed_grpo", 16)
  got, _ = _run("seed_grpo", arrays, alpha=0.7, estimator=estimator, **static)
  want = ref_seed(arrays["rewards"], arrays["group_ids"], arrays["response_mask"], arrays["cluster_ids"], 0.7,
                  estimator)
  np.testing.assert_allclose(got, _bcast(want, arrays["response_mask"]), **TOL)


def test_seed_grpo_precomputed_entropy_equals_cluster_ids():
  arrays, static = _case("seed_grpo", 17)
  from_clusters, metrics = _run("seed_grpo", arrays, **static)
  se = np.full(len(arrays["rewards"]), metrics["semantic_entropy_mean"])
  r, g, m, c = (arrays[k] for k in ("rewards", "group_ids", "response_mask", "cluster_ids"))
  valid = m.any(1)
  for i in np.flatnonzero(valid):
    ms = _members(g, valid, i)
    p = np.array([np.sum(c[ms] == u) for u in np.unique(c[ms])]) / len(ms)
    se[i] = -np.mean(np.log(p))
  direct, _ = _run("seed_grpo", dict(rewards=r, group_ids=g, response_mask=m, semantic_entropy=se))
  np.testing.assert_allclose(direct, from_clusters, **TOL)


def test_arpo_hard_hand_example_shared_prefix_gets_mean_advantage():
  # Rows 0 and 1 share their first two tokens; GRPO advantages sqrt(2), -1/sqrt(2), -1/sqrt(2);
  # the shared tokens get (sqrt(2) - 1/sqrt(2)) / 2 = 1/(2 sqrt(2)).
  pid = [[0, 1, -1], [0, 1, -1], [-1, -1, -1]]
  arrays = dict(rewards=[1.0, 0.0, 0.0], group_ids=[0, 0, 0], response_mask=np.ones((3, 3)), prefix_ids=pid)
  got, metrics = _run("arpo_hard", arrays, eps=0.0)
  s, h = math.sqrt(2), 1 / (2 * math.sqrt(2))
  np.testing.assert_allclose(got, [[h, h, s], [h, h, -1 / s], [-1 / s, -1 / s, -1 / s]], **TOL)
  assert metrics["shared_token_fraction"] == pytest.approx(4 / 9)


def test_arpo_hard_matches_reference_on_random_trees():
  arrays, _ = _case("arpo_hard", 18)
  got, _ = _run("arpo_hard", arrays)
  want = ref_arpo_hard(arrays["rewards"], arrays["group_ids"], arrays["response_mask"], arrays["prefix_ids"])
  np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("name", ["arpo_hard", "arpo_soft"])
def test_arpo_without_shared_prefix_equals_grpo(name):
  r, g, m = _batch(19)
  arrays = dict(rewards=r, group_ids=g, response_mask=m)
  got, _ = _run(name, {**arrays, "prefix_ids": -np.ones(m.shape, np.int64)})
  np.testing.assert_array_equal(got, _run("grpo", arrays)[0])


def test_arpo_soft_keeps_per_branch_advantages_on_shared_tokens():
  arrays, _ = _case("arpo_soft", 20)
  got, metrics = _run("arpo_soft", arrays)
  base = {k: arrays[k] for k in ("rewards", "group_ids", "response_mask")}
  np.testing.assert_array_equal(got, _run("grpo", base)[0])
  assert metrics["shared_token_fraction"] > 0.0


# --------------------------------------------------------------------------------------------------
# Edge cases, registry, jit/vmap, shard_map.


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_equal_rewards_in_a_group_give_exactly_zero(name):
  arrays, static = _case(name, 21)
  r, g = arrays["rewards"].copy(), arrays["group_ids"]
  r[g == 7] = 0.1  # 8 members, all equal (0.1 is not exact in binary: no rounding-noise leaks)
  got, _ = _run(name, {**arrays, "rewards": r}, **static)
  assert np.all(got[g == 7] == 0.0)
  assert np.all(got[g == 3] == 0.0)


def test_all_registered_names():
  assert set(adv_lib.ADVANTAGES) == {
      "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "gpg",
      "grpo_passk", "maxrl", "gae", "egae", "global_normalize", "seed_grpo", "arpo_hard", "arpo_soft"}
  assert set(adv_lib.__all__) >= set(adv_lib.ADVANTAGES)


@pytest.mark.parametrize("name", sorted(adv_lib.ADVANTAGES))
def test_single_sample_groups_and_empty_masks_are_finite_zero(name):
  arrays, static = _case(name, 22)
  # The options common to the registry are accepted by every estimator.
  arrays = {**arrays, "sample_mask": arrays["response_mask"].any(1)}
  got, metrics = _run(name, arrays, num_groups=len(GROUP_SIZES), **static)
  m, g = arrays["response_mask"], arrays["group_ids"]
  assert np.all(np.isfinite(got)) and all(np.isfinite(v) for v in metrics.values())
  assert np.all(got[m == 0] == 0.0)
  if name in GROUP_ESTIMATORS:
    assert np.all(got[g == 0] == 0.0)  # group 0 has one member


def test_all_empty_masks_give_zero_and_finite_metrics():
  arrays = dict(rewards=[1.0, 0.0], group_ids=[0, 0], response_mask=np.zeros((2, 3)))
  for name in ("grpo", "global_normalize", "reinforce_pp", "rloo"):
    got, metrics = _run(name, arrays)
    assert np.all(got == 0.0) and all(np.isfinite(v) for v in metrics.values())


def test_register_advantage_rejects_duplicates_and_invalid_levels():
  with pytest.raises(ValueError, match="already registered"):
    adv_lib.register_advantage("grpo")(lambda **kw: None)
  with pytest.raises(ValueError, match="mean_level"):
    _run("grpo", dict(rewards=[1.0], group_ids=[0], response_mask=[[1]]), mean_level="prompt")
  try:
    fn = adv_lib.register_advantage("_test_only")(lambda **kw: "a")
    assert adv_lib.ADVANTAGES["_test_only"] is fn
    adv_lib.register_advantage("_test_only", overwrite=True)(lambda **kw: "b")
    assert adv_lib.ADVANTAGES["_test_only"]() == "b"
  finally:
    adv_lib.ADVANTAGES.pop("_test_only", None)


# One estimator per distinct code path (group segments, falling ratios, scans, cluster and prefix
# segments, token whitening); the others are compositions of these and are vmapped eagerly below.
JITTED = ("arpo_hard", "egae", "gae", "global_normalize", "grpo", "grpo_passk", "reinforce_pp", "seed_grpo")


@pytest.mark.parametrize("name,use_jit", [(n, n in JITTED) for n in sorted(adv_lib.ADVANTAGES)])
def test_vmap_equals_per_problem_eager(name, use_jit):
  cases = [_case(name, 30 + i) for i in range(2)]
  static = cases[0][1]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[_jnp(a) for a, _ in cases])
  fn = jax.vmap(functools.partial(adv_lib.ADVANTAGES[name], **static))
  got, metrics = (jax.jit(fn) if use_jit else fn)(**stacked)
  for i, (arrays, _) in enumerate(cases):
    want, want_metrics = _run(name, arrays, **static)
    np.testing.assert_allclose(np.asarray(got[i]), want, **TOL)
    np.testing.assert_allclose(float(metrics["advantage_mean"][i]), want_metrics["advantage_mean"], **TOL)


SHARDED = {
    "grpo": dict(num_groups=8),
    "global_normalize": dict(num_groups=8, mean_level="group", std_level="batch"),
    "arpo_hard": dict(num_groups=8, num_prefixes=32 * 6),
}


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_shard_map_global_statistics_equal_unsharded(name):
  """Groups span the 8 data shards; psum-ed statistics must reproduce the single-device result."""
  mesh = make_mesh({"data": 8})
  r, g, m = _batch(40, t=6, sizes=(4,) * 8)
  arrays = dict(rewards=r, group_ids=g, response_mask=m)
  if name == "arpo_hard":
    arrays["prefix_ids"] = _tree(g, m, 40)
  keys = sorted(arrays)
  fn = adv_lib.ADVANTAGES[name]
  static = SHARDED[name]

  def body(*xs):
    return fn(**dict(zip(keys, xs)), **static, axis_name="data")

  specs = tuple(P("data", None) if np.ndim(arrays[k]) == 2 else P("data") for k in keys)
  sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("data", None), P())))
  got, metrics = sharded(*[_jnp(arrays)[k] for k in keys])
  want, want_metrics = _run(name, arrays, **static)
  np.testing.assert_allclose(np.asarray(got), want, **TOL)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(float(metrics[k]), v, **TOL, err_msg=k)
