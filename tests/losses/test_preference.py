"""Preference losses against float64 numpy references from the papers, packing invariance, DPO metrics
by hand, and parity with TRL 0.19.1 (fixtures from tests/fixtures/make_preference_fixtures.py)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from jaxrl import data, losses

B = 16


def _logsig(x):
  return -np.logaddexp(0.0, -x)


def _h(c, r, rc, rr):
  return (c - rc) - (r - rr)


# Float64 numpy references, written from the papers' formulas. Each takes (c, r, rc, rr, opts) with
# summed log-probs [B] and returns per-pair losses [B].
def _np_sigmoid(c, r, rc, rr, o):
  bh = o["beta"] * _h(c, r, rc, rr)
  return -(1 - o["label_smoothing"]) * _logsig(bh) - o["label_smoothing"] * _logsig(-bh)


def _np_robust(c, r, rc, rr, o):
  bh, e = o["beta"] * _h(c, r, rc, rr), o["label_smoothing"]
  return ((1 - e) * -_logsig(bh) - e * -_logsig(-bh)) / (1 - 2 * e)


def _np_ipo(c, r, rc, rr, o):
  return (_h(c, r, rc, rr) - 1 / (2 * o["beta"])) ** 2


def _np_hinge(c, r, rc, rr, o):
  return np.maximum(0.0, 1 - o["beta"] * _h(c, r, rc, rr))


def _np_simpo(c, r, rc, rr, o):
  z = o["beta"] * c / o["chosen_lengths"] - o["beta"] * r / o["rejected_lengths"] - o["gamma"]
  return -(1 - o["label_smoothing"]) * _logsig(z) - o["label_smoothing"] * _logsig(-z)


def _np_orpo(c, r, rc, rr, o):
  cw, cl = c / o["chosen_lengths"], r / o["rejected_lengths"]
  odds = lambda lp: np.exp(lp) / (1 - np.exp(lp))  # noqa: E731
  return -cw - o["beta"] * _logsig(np.log(odds(cw) / odds(cl)))


CASES = {
    "sigmoid": (_np_sigmoid, {"beta": 0.1}),
    "sigmoid_cdpo": (_np_sigmoid, {"beta": 0.3, "label_smoothing": 0.2}),
    "robust": (_np_robust, {"beta": 0.1, "label_smoothing": 0.1}),
    "ipo": (_np_ipo, {"beta": 0.5}),
    "hinge": (_np_hinge, {"beta": 0.2}),
    "simpo": (_np_simpo, {"beta": 2.0, "gamma": 0.7, "chosen_lengths": True}),
    "simpo_smooth": (_np_simpo, {"beta": 2.5, "gamma": 1.0, "label_smoothing": 0.1, "chosen_lengths": True}),
    "orpo": (_np_orpo, {"beta": 0.25, "chosen_lengths": True}),
}


def _inputs(seed):
  rng = np.random.default_rng(seed)
  lc, lr = rng.integers(3, 12, B).astype(np.float64), rng.integers(3, 12, B).astype(np.float64)
  c, r = -lc * rng.uniform(0.2, 2.0, B), -lr * rng.uniform(0.2, 2.0, B)
  rc, rr = c + rng.normal(0, 2.0, B), r + rng.normal(0, 2.0, B)
  return (c, r, rc, rr), lc, lr


def _options(case, lc, lr):
  _, opts = CASES[case]
  opts = {"label_smoothing": 0.0, "gamma": 0.0, **opts}
  if opts.pop("chosen_lengths", False):
    opts["chosen_lengths"], opts["rejected_lengths"] = lc, lr
  return opts


def _fd_grad(f, xs, eps=1e-6):
  """Central finite differences of Σ f(xs) w.r.t. each of the arrays in xs (float64)."""
  grads = []
  for k, x in enumerate(xs):
    g = np.zeros_like(x)
    for i in range(x.size):
      up = [y.copy() for y in xs]
      dn = [y.copy() for y in xs]
      up[k][i] += eps
      dn[k][i] -= eps
      g[i] = (f(*up).sum() - f(*dn).sum()) / (2 * eps)
    grads.append(g)
  return grads


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_match_numpy_reference(case, seed):
  ref_fn, _ = CASES[case]
  xs, lc, lr = _inputs(seed)
  opts = _options(case, lc, lr)
  name = case.split("_")[0]
  with enable_x64():
    jopts = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in opts.items()}
    if name in ("sigmoid", "robust", "ipo", "hinge", "orpo"):
      jopts.pop("gamma")
    if name in ("ipo", "hinge", "orpo"):
      jopts.pop("label_smoothing")
    fn = lambda *a: losses.PREFERENCE_LOSSES[name](*a, **jopts)[0]  # noqa: E731
    jx = [jnp.asarray(x) for x in xs]
    got = np.asarray(fn(*jx))
    grads = [np.asarray(g) for g in jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2, 3))(*jx)]
    via_registry = np.asarray(losses.preference_loss(name, *jx, **jopts)[0])
  assert got.dtype == np.float64
  want = ref_fn(*xs, opts)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(via_registry, want, rtol=1e-5, atol=1e-12)
  want_grads = _fd_grad(lambda *a: ref_fn(*a, opts), list(xs))
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  if name in ("simpo", "orpo"):  # reference-free
    assert not np.any(grads[2]) and not np.any(grads[3])


def test_float32_inputs_give_float32_losses_close_to_float64():
  xs, _, _ = _inputs(3)
  got, metrics = losses.preference_loss("sigmoid", *[jnp.asarray(x, jnp.float32) for x in xs], beta=0.1)
  assert got.dtype == jnp.float32 and metrics["margins"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _np_sigmoid(*xs, {"beta": 0.1, "label_smoothing": 0.0}),
                             rtol=1e-5)


def test_dpo_metrics_hand_worked():
  # pair 0: policy gains 1 nat on chosen, loses 1 on rejected; pair 1 the reverse; pair 2 a tie.
  c = jnp.array([-10.0, -12.0, -5.0])
  r = jnp.array([-12.0, -10.0, -5.0])
  ref = jnp.array([-11.0, -11.0, -5.0])
  loss, m = losses.preference_loss("sigmoid", c, r, ref, ref, beta=0.1)
  np.testing.assert_allclose(m["rewards_chosen"], [0.1, -0.1, 0.0], atol=1e-7)
  np.testing.assert_allclose(m["rewards_rejected"], [-0.1, 0.1, 0.0], atol=1e-7)
  np.testing.assert_allclose(m["margins"], [0.2, -0.2, 0.0], atol=1e-7)
  np.testing.assert_array_equal(m["accuracy"], [1.0, 0.0, 0.0])
  # -log σ(0.2) = log(1 + e^-0.2) = 0.598138869...; -log σ(-0.2) = 0.798138869...; -log σ(0) = log 2
  np.testing.assert_allclose(loss, [0.5981388693, 0.7981388693, 0.6931471806], rtol=1e-6)


@pytest.mark.parametrize("name", sorted(losses.PREFERENCE_LOSSES))
def test_every_loss_jits_and_vmaps(name):
  xs, lc, lr = _inputs(4)
  xs = [jnp.asarray(x, jnp.float32) for x in xs]
  opts = {"beta": 0.3}
  if name in ("simpo", "orpo"):
    opts.update(chosen_lengths=jnp.asarray(lc, jnp.float32), rejected_lengths=jnp.asarray(lr, jnp.float32))
  eager, m = losses.preference_loss(name, *xs, **opts)
  jitted, mj = jax.jit(lambda *a: losses.preference_loss(name, *a, **opts))(*xs)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6)
  assert set(mj) == set(m) >= {"rewards_chosen", "rewards_rejected", "margins", "accuracy"}
  one = jax.vmap(lambda c, r, rc, rr: losses.PREFERENCE_LOSSES[name](c[None], r[None], rc[None], rr[None],
                                                                     beta=0.3)[0][0])
  if name not in ("simpo", "orpo"):
    np.testing.assert_allclose(np.asarray(one(*xs)), np.asarray(eager), rtol=1e-6)


def test_preference_loss_rejects_unused_options_and_unknown_names():
  x = jnp.zeros(2)
  with pytest.raises(ValueError, match="does not use gamma"):
    losses.preference_loss("sigmoid", x, x, x, x, gamma=0.5)
  with pytest.raises(ValueError, match="does not use chosen_lengths"):
    losses.preference_loss("ipo", x, x, x, x, chosen_lengths=jnp.ones(2))
  with pytest.raises(ValueError, match="unknown preference loss"):
    losses.preference_loss("dpo", x, x, x, x)
  with pytest.raises(ValueError, match="label_smoothing"):
    losses.preference_loss("robust", x, x, x, x, label_smoothing=0.5)


def test_kto_loss_and_reference_point():
  rng = np.random.default_rng(5)
  lp, ref = -rng.uniform(2, 20, 12), -rng.uniform(2, 20, 12)
  des = rng.random(12) < 0.5
  kl_lp, kl_ref = -rng.uniform(2, 20, 12), -rng.uniform(2, 20, 12)
  beta, wd, wu = 0.2, 1.0, 1.5
  with enable_x64():
    z0 = losses.kto_kl_reference(jnp.asarray(kl_lp), jnp.asarray(kl_ref))
    def f(a, b):
      return losses.kto_loss(a, b, des, beta=beta, desirable_weight=wd, undesirable_weight=wu, kl_ref=z0)[0]
    got = np.asarray(f(jnp.asarray(lp), jnp.asarray(ref)))
    g = np.asarray(jax.grad(lambda a: f(a, jnp.asarray(ref)).sum())(jnp.asarray(lp)))
    g_kl = np.asarray(jax.grad(lambda a: losses.kto_kl_reference(a, jnp.asarray(kl_ref)))(jnp.asarray(kl_lp)))
    zero = float(losses.kto_kl_reference(jnp.asarray(kl_ref), jnp.asarray(kl_ref) + 1.0))
  want_z0 = max(0.0, float(np.mean(kl_lp - kl_ref)))
  assert float(z0) == pytest.approx(want_z0, rel=1e-12)
  sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
  r = lp - ref
  want = np.where(des, wd * (1 - sig(beta * (r - want_z0))), wu * (1 - sig(beta * (want_z0 - r))))
  np.testing.assert_allclose(got, want, rtol=1e-10)
  fd = _fd_grad(lambda a: np.where(des, wd * (1 - sig(beta * (a - ref - want_z0))),
                                   wu * (1 - sig(beta * (want_z0 - a + ref)))), [lp])[0]
  np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-9)
  assert not np.any(g_kl)  # z0 is detached
  assert zero == 0.0  # a negative KL estimate is clamped


def test_bradley_terry_loss_with_margin_and_centring():
  rng = np.random.default_rng(7)
  rc, rr, m = rng.normal(0, 2, B), rng.normal(0, 2, B), rng.uniform(0, 1, B)
  f_np = lambda a, b: -_logsig(a - b - m) + 0.05 * (a + b) ** 2  # noqa: E731
  with enable_x64():
    f = lambda a, b: losses.bradley_terry_loss(a, b, margin=jnp.asarray(m), center_coef=0.05)  # noqa: E731
    got, metrics = f(jnp.asarray(rc), jnp.asarray(rr))
    grads = jax.grad(lambda a, b: f(a, b)[0].sum(), argnums=(0, 1))(jnp.asarray(rc), jnp.asarray(rr))
  np.testing.assert_allclose(np.asarray(got), f_np(rc, rr), rtol=1e-10)
  for g, w in zip(grads, _fd_grad(f_np, [rc, rr])):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-8)
  np.testing.assert_array_equal(np.asarray(metrics["accuracy"]), (rc > rr).astype(np.float64))


# ---------------------------------------------------------------------------------------------
# Packing invariance.


def _pack(seqs, order, row_len, per_row):
  """Packs (prompt_len, token logps) sequences into rows of ``row_len``, ``per_row`` segments each, in
  ``order``. Returns token_logps, segment_ids, mask [R, T], sequence_map [R, per_row+1], and the
  (row, start, stop) of each sequence's completion tokens."""
  rows = -(-len(order) // per_row)
  lp = np.zeros((rows, row_len))
  seg = np.zeros((rows, row_len), np.int32)
  mask = np.zeros((rows, row_len))
  smap = -np.ones((rows, per_row + 1), np.int32)
  where = {}
  for j, s in enumerate(order):
    row, k = divmod(j, per_row)
    o = int(seg[row].astype(bool).sum())
    prompt, tok = seqs[s]
    n = prompt + len(tok)
    seg[row, o:o + n] = k + 1
    lp[row, o:o + prompt] = -7.0  # prompt tokens: masked out
    lp[row, o + prompt:o + n] = tok
    mask[row, o + prompt:o + n] = 1.0
    smap[row, k + 1] = s
    where[s] = (row, o + prompt, o + n)
  return lp, seg, mask, smap, where


@pytest.mark.parametrize("name,mode",
                         [("sigmoid", "sum"), ("ipo", "mean"), ("simpo", "mean"), ("orpo", "sum")])
def test_packing_invariance(name, mode):
  rng = np.random.default_rng(11)
  pairs = 6
  seqs = [(int(rng.integers(1, 4)), -rng.uniform(0.05, 1.5, int(rng.integers(2, 9))))
          for _ in range(2 * pairs)]
  ref = -rng.uniform(2, 10, 2 * pairs)
  # Sequence 2i is the chosen and 2i+1 the rejected of pair i. Layout A: a pair shares a row.
  # Layout B: one sequence per row, shuffled, longer rows. Layout C: three per row, pairs split apart.
  layouts = [_pack(seqs, list(range(2 * pairs)), 24, 2),
             _pack(seqs, list(rng.permutation(2 * pairs)), 16, 1),
             _pack(seqs, [0, 3, 5, 2, 1, 7, 9, 11, 4, 6, 8, 10], 40, 3)]
  opts = {"beta": 0.5}
  if name in ("simpo", "orpo") and mode == "sum":
    opts["chosen_lengths"] = jnp.asarray([len(seqs[2 * i][1]) for i in range(pairs)], jnp.float32)
    opts["rejected_lengths"] = jnp.asarray([len(seqs[2 * i + 1][1]) for i in range(pairs)], jnp.float32)

  results = []
  for lp, seg, mask, smap, where in layouts:
    def loss_fn(token_lp, seg=seg, mask=mask, smap=smap):
      s = losses.sequence_logps(token_lp, seg, mask, 2 * pairs, mode, sequence_map=smap)  # [S]
      per_pair, _ = losses.preference_loss(name, s[0::2], s[1::2], jnp.asarray(ref[0::2]),
                                           jnp.asarray(ref[1::2]), **opts)
      return jnp.mean(per_pair), s
    (loss, s), g = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(lp, jnp.float32))
    g = np.asarray(g)
    assert not np.any(g[np.asarray(mask) == 0])  # prompt and padding get no gradient
    grads = [g[row, a:b] for row, a, b in (where[k] for k in range(2 * pairs))]
    results.append((float(loss), np.asarray(s), grads))

  want_s = np.array([t.sum() if mode == "sum" else t.mean() for _, t in seqs])
  for loss, s, grads in results:
    np.testing.assert_allclose(s, want_s, rtol=1e-6)
    assert loss == pytest.approx(results[0][0], rel=1e-6)
    for g, g0 in zip(grads, results[0][2]):
      np.testing.assert_allclose(g, g0, rtol=1e-6, atol=1e-9)
  lengths = losses.sequence_lengths(layouts[2][1], layouts[2][2], 2 * pairs, sequence_map=layouts[2][3])
  np.testing.assert_array_equal(np.asarray(lengths), [len(t) for _, t in seqs])


@pytest.mark.parametrize("method,seq_len", [("none", 16), ("best_fit", 24), ("first_fit_decreasing", 40)])
def test_sequence_logps_from_the_data_packer(method, seq_len):
  """Rows from ``jaxrl.data.pack_samples``; ``sequence_map`` from ``assign_rows`` (the same rows)."""
  rng = np.random.default_rng(13)
  vocab = 9
  table = np.log(rng.dirichlet(np.ones(vocab), vocab))  # [V, V] log p(next | token)
  samples, want = [], []
  for _ in range(10):
    prompt, completion = int(rng.integers(1, 5)), int(rng.integers(1, 8))
    tok = rng.integers(0, vocab, prompt + completion).astype(np.int32)
    mask = np.r_[np.zeros(prompt), np.ones(completion)].astype(np.float32)
    samples.append({"tokens": tok, "loss_mask": mask, "turn_id": mask.astype(np.int32)})
    want.append(sum(table[tok[t], tok[t + 1]] for t in range(prompt - 1, prompt + completion - 1)))
  rows = data.assign_rows([len(x["tokens"]) for x in samples], seq_len, method=method)
  packed = data.pack_samples(samples, seq_len, method=method)
  smap = -np.ones((len(rows), 1 + max(map(len, rows))), np.int32)
  for r, members in enumerate(rows):
    smap[r, 1:1 + len(members)] = members
  token_lp = table[packed["tokens"], packed["targets"]]  # [R, T]
  got = losses.sequence_logps(token_lp, packed["segment_ids"], packed["loss_mask"], len(samples),
                              sequence_map=smap)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_sequence_logps_global_segment_ids_without_map():
  lp = jnp.array([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, 0.0, 0.0]])
  seg = jnp.array([[1, 1, 3, 3], [2, 2, 0, 0]])
  mask = jnp.array([[0, 1, 1, 1], [1, 1, 0, 0]])
  np.testing.assert_allclose(losses.sequence_logps(lp, seg, mask, 3), [-2.0, -11.0, -7.0])
  np.testing.assert_allclose(losses.sequence_logps(lp, seg, mask, 3, "mean"), [-2.0, -5.5, -3.5])
  with pytest.raises(ValueError, match="mode"):
    losses.sequence_logps(lp, seg, mask, 3, "max")


# ---------------------------------------------------------------------------------------------
# Parity with TRL 0.19.1 (tests/fixtures/make_preference_fixtures.py, float64; the `trl` fixture is in tests/losses/conftest.py).


def _ours(name, args, **opts):
  """Per-pair losses, metrics and the gradients of their sum w.r.t. every positional input (x64)."""
  with enable_x64():
    jx = [jnp.asarray(a) for a in args]
    fn = lambda *a: losses.preference_loss(name, *a, **opts)  # noqa: E731
    loss, metrics = fn(*jx)
    grads = jax.grad(lambda *a: fn(*a)[0].sum(), argnums=tuple(range(len(jx))))(*jx)
    return np.asarray(loss), {k: np.asarray(v) for k, v in metrics.items()}, [np.asarray(g) for g in grads]


@pytest.mark.parametrize("case,name", [("sigmoid", "sigmoid"), ("cdpo", "sigmoid"), ("robust", "robust"),
                                       ("hinge", "hinge"), ("ipo", "ipo")])
def test_dpo_family_matches_trl(trl, case, name):
  opts = {"beta": float(trl[f"{case}/beta"])}
  if name in ("sigmoid", "robust"):
    opts["label_smoothing"] = float(trl[f"{case}/label_smoothing"])
  loss, m, grads = _ours(name, [trl[k] for k in ("c", "r", "rc", "rr")], **opts)
  np.testing.assert_allclose(loss, trl[f"{case}/losses"], rtol=1e-5)
  for g, k in zip(grads, ("c", "r", "rc", "rr")):
    np.testing.assert_allclose(g, trl[f"{case}/grad_{k}"], rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(m["rewards_chosen"], trl[f"{case}/chosen_rewards"], rtol=1e-5)
  np.testing.assert_allclose(m["rewards_rejected"], trl[f"{case}/rejected_rewards"], rtol=1e-5)


def test_ipo_follows_the_paper_and_trl_is_ipo_on_mean_logprobs(trl):
  """The documented difference: TRL's trainer feeds IPO per-token mean log-probs; the paper sums."""
  c, r, rc, rr, lc, lr = (trl[k] for k in ("c", "r", "rc", "rr", "lc", "lr"))
  ours_sum, _, _ = _ours("ipo", [c, r, rc, rr], beta=0.5)
  assert np.max(np.abs(ours_sum / trl["ipo_trl/losses"] - 1)) > 0.1
  with enable_x64():
    fn = lambda c, r, rc, rr: losses.ipo(c / lc, r / lr, rc / lc, rr / lr, beta=0.5)[0]  # noqa: E731
    jx = [jnp.asarray(a) for a in (c, r, rc, rr)]
    loss = np.asarray(fn(*jx))
    grads = jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2, 3))(*jx)
  np.testing.assert_allclose(loss, trl["ipo_trl/losses"], rtol=1e-5)
  for g, k in zip(grads, ("c", "r", "rc", "rr")):
    np.testing.assert_allclose(np.asarray(g), trl[f"ipo_trl/grad_{k}"], rtol=1e-5, atol=1e-12)


def test_simpo_matches_trl_cpo(trl):
  loss, m, grads = _ours("simpo", [trl["c"], trl["r"]], beta=2.0, gamma=0.7, label_smoothing=0.1,
                         chosen_lengths=trl["lc"], rejected_lengths=trl["lr"])
  np.testing.assert_allclose(loss, trl["simpo/losses"], rtol=1e-5)
  np.testing.assert_allclose(grads[0], trl["simpo/grad_c"], rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(grads[1], trl["simpo/grad_r"], rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(m["rewards_chosen"], trl["simpo/chosen_rewards"], rtol=1e-5)


def test_orpo_odds_ratio_term_matches_trl(trl):
  """TRL's ``odds_ratio_loss`` returns ``β log σ(·)``, which its trainer subtracts from the NLL."""
  loss, _, grads = _ours("orpo", [trl["c"], trl["r"]], beta=0.25, chosen_lengths=trl["lc"],
                         rejected_lengths=trl["lr"], chosen_nll=np.zeros(len(trl["c"])))
  np.testing.assert_allclose(loss, -trl["orpo/losses"], rtol=1e-5)
  np.testing.assert_allclose(grads[0], -trl["orpo/grad_c"], rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(grads[1], -trl["orpo/grad_r"], rtol=1e-5, atol=1e-12)


def test_kto_matches_trl(trl):
  des = trl["kto/desirable"]
  with enable_x64():
    z0 = losses.kto_kl_reference(jnp.asarray(trl["kto/kl_logps"]), jnp.asarray(trl["kto/kl_ref_logps"]))
    fn = lambda lp: losses.kto_loss(lp, jnp.asarray(trl["kto/ref_logps"]), des, beta=0.2,  # noqa: E731
                                    desirable_weight=1.0, undesirable_weight=1.5, kl_ref=z0)[0]
    lp = jnp.asarray(trl["kto/logps"])
    loss = np.asarray(fn(lp))
    grad = np.asarray(jax.grad(lambda a: fn(a).sum())(lp))
  assert float(z0) > 0.0  # the KL point is active in this fixture
  np.testing.assert_allclose(np.concatenate([loss[des], loss[~des]]), trl["kto/losses"], rtol=1e-5)
  np.testing.assert_allclose(grad, trl["kto/grad_logps"], rtol=1e-5, atol=1e-12)


def test_bradley_terry_matches_trl_reward_trainer(trl):
  with enable_x64():
    fn = lambda a, b: jnp.mean(losses.bradley_terry_loss(  # noqa: E731
        a, b, margin=jnp.asarray(trl["bt/margin"]), center_coef=0.05)[0])
    jx = [jnp.asarray(trl["bt/rc"]), jnp.asarray(trl["bt/rr"])]
    loss = float(fn(*jx))
    grads = jax.grad(fn, argnums=(0, 1))(*jx)
  assert loss == pytest.approx(float(trl["bt/loss"]), rel=1e-5)
  np.testing.assert_allclose(np.asarray(grads[0]), trl["bt/grad_rc"], rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(np.asarray(grads[1]), trl["bt/grad_rr"], rtol=1e-5, atol=1e-12)


def _np_gkd(student, teacher, labels, beta, temperature):
  """TRL's generalised JSD: β=0 is KL(teacher‖student), β=1 KL(student‖teacher), else
  β KL(T‖M) + (1-β) KL(S‖M) with M = β T + (1-β) S; mean over the unmasked tokens."""
  def log_softmax(z):
    z = z / temperature
    return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
  s, t = log_softmax(student), log_softmax(teacher)
  if beta == 0.0:
    tok = np.sum(np.exp(t) * (t - s), -1)
  elif beta == 1.0:
    tok = np.sum(np.exp(s) * (s - t), -1)
  else:
    m = np.logaddexp(s + np.log(1 - beta), t + np.log(beta))
    tok = beta * np.sum(np.exp(t) * (t - m), -1) + (1 - beta) * np.sum(np.exp(s) * (s - m), -1)
  mask = labels != -100
  return np.sum(tok[mask]) / np.sum(mask)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_fixture_is_the_generalised_jsd(trl, beta):
  """Validates the recorded TRL GKD values (for the distillation loss) against an independent numpy JSD."""
  s, t, labels = trl["gkd/student"], trl["gkd/teacher"], trl["gkd/labels"]
  temp = float(trl["gkd/temperature"])
  assert float(trl[f"gkd_{beta}/loss"]) == pytest.approx(_np_gkd(s, t, labels, beta, temp), rel=1e-10)
  fd = _fd_grad(lambda x: np.atleast_1d(_np_gkd(x.reshape(s.shape), t, labels, beta, temp)),
                [s.reshape(-1)])[0]
  np.testing.assert_allclose(trl[f"gkd_{beta}/grad_student"].reshape(-1), fd, rtol=1e-5, atol=1e-9)
