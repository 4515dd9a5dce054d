"""SFT loss weighting: the note's formulas by hand, packing (in)variance, split invariance."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.losses._sft import (
    SFT_LOSSES,
    sft_global_counts,
    sft_loss_weights,
    sft_row_mean,
    sft_sample_mean,
)
from jaxrl.sharding import make_mesh

# Two packed rows (target-aligned). Row 0: sample 1 (loss nll 1, 2, 3; turn 1) then sample 2
# (nll 4; turn 2). Row 1: sample 3, two turns (turn 3: nll 2, 4; turn 4: nll 6, 2), then padding.
# Untrained positions carry nll 9 that must never count.
HAND = dict(
    nll=np.array([[1, 2, 3, 9, 4, 9], [2, 4, 9, 6, 2, 9]], np.float32),
    loss_mask=np.array([[1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 1, 0]], np.float32),
    sample_ids=np.array([[1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 0]], np.int32),
    turn_ids=np.array([[1, 1, 1, 0, 2, 0], [3, 3, 0, 4, 4, 0]], np.int32),
)

# Σ l = 24 over 8 loss tokens; rows 2; true samples 3 (means 2, 4, 3.5); turns 4 (means 2, 4, 3, 4);
# packed-row means 10/4 = 2.5 and 14/4 = 3.5.
HAND_EXPECTED = [
    ("token_sum", "none", None, 24.0),
    ("token_sum", "gbs", 4.0, 6.0),  # 24 / GBS (constant 4)
    ("global_token_mean", None, None, 3.0),  # 24 / 8
    ("row_mean", "none", None, 6.0),  # 2.5 + 3.5
    ("row_mean", "gbs", None, 3.0),  # (2.5 + 3.5) / 2 rows
    ("sample_mean", "none", None, 9.5),  # 2 + 4 + 3.5
    ("sample_mean", "gbs", None, 4.75),  # 9.5 / 2 rows
    ("sample_mean", "gbs_true", None, 9.5 / 3),  # 9.5 / 3 true samples
    ("turn_mean", "none", None, 13.0),  # 2 + 4 + 3 + 4
    ("turn_mean", "gbs", None, 6.5),  # 13 / 2 rows
    ("turn_mean", "gbs_true", None, 3.25),  # 13 / 4 turns
]


@pytest.mark.parametrize("mode,divisor,gbs,expected", HAND_EXPECTED)
def test_hand_computed_loss_matches_note_formula(mode, divisor, gbs, expected):
  loss, metrics = SFT_LOSSES[mode](
      HAND["nll"], HAND["loss_mask"], HAND["sample_ids"], HAND["turn_ids"], divisor=divisor, gbs=gbs)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  assert float(metrics["loss_tokens"]) == 8.0
  assert float(metrics["nll_sum"]) == 24.0


def test_global_counts_of_hand_batch():
  counts = sft_global_counts(HAND["loss_mask"], HAND["sample_ids"], HAND["turn_ids"])
  assert [float(c) for c in counts] == [8.0, 3.0, 4.0, 2.0]  # tokens, samples, turns, rows


def test_turn_mean_gives_each_turn_equal_weight():
  # One conversation, two turns of 1 and 5 loss tokens.
  mask = np.array([[0, 1, 0, 1, 1, 1, 1, 1]], np.float32)
  turns = np.array([[0, 1, 0, 2, 2, 2, 2, 2]], np.int32)
  samples = np.ones_like(turns)
  w = np.asarray(sft_loss_weights("turn_mean", mask, samples, turns, divisor="gbs_true"))
  np.testing.assert_allclose([w[turns == 1].sum(), w[turns == 2].sum()], [0.5, 0.5], rtol=1e-6)
  np.testing.assert_allclose(w[turns == 2], 0.1, rtol=1e-6)
  # sample_mean on the same conversation instead weighs turns by their length (1/6 vs 5/6).
  w_s = np.asarray(sft_loss_weights("sample_mean", mask, samples, turns, divisor="gbs_true"))
  np.testing.assert_allclose([w_s[turns == 1].sum(), w_s[turns == 2].sum()], [1 / 6, 5 / 6], rtol=1e-6)


def test_untrained_positions_do_not_leak_nonfinite_nll():
  nll = HAND["nll"].copy()
  nll[HAND["loss_mask"] == 0] = np.inf
  loss, _ = sft_sample_mean(nll, HAND["loss_mask"], HAND["sample_ids"], HAND["turn_ids"])
  np.testing.assert_allclose(loss, 9.5 / 3, rtol=1e-6)


def test_unknown_mode_and_divisor_are_errors():
  with pytest.raises(ValueError, match="'mean'"):
    sft_loss_weights("mean", HAND["loss_mask"], HAND["sample_ids"], HAND["turn_ids"])
  with pytest.raises(ValueError, match="row_mean.*'gbs_true'"):
    sft_row_mean(HAND["nll"], HAND["loss_mask"], divisor="gbs_true")


# ----------------------------------------------------------------------------------------------
# Packed vs unpacked: the same true samples, one per row or packed several per row.


def _random_samples(rng, n, max_len=12):
  """Per-sample target-aligned (nll, mask, turn) with 1-3 turns and lengths 2..max_len."""
  samples = []
  for _ in range(n):
    length = int(rng.integers(2, max_len + 1))
    mask = np.zeros(length, np.float32)
    turn = np.zeros(length, np.int32)
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(2, length - 1), replace=False))
    for t, (a, b) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, length]), start=1):
      # a turn: prompt part untrained, then trained tokens
      start = int(a + rng.integers(0, max(1, b - a)))
      mask[start:b] = 1
      turn[start:b] = t
    samples.append((rng.uniform(0.1, 5.0, length).astype(np.float32), mask, turn))
  return samples


def _layout(samples, rows, seq_len):
  """Arrays [len(rows), seq_len] placing samples (indices per row) back to back."""
  r = len(rows)
  out = dict(nll=np.zeros((r, seq_len), np.float32), loss_mask=np.zeros((r, seq_len), np.float32),
             sample_ids=np.zeros((r, seq_len), np.int32), turn_ids=np.zeros((r, seq_len), np.int32))
  sid, tid = 0, 0
  for i, members in enumerate(rows):
    o = 0
    for j in members:
      nll, mask, turn = samples[j]
      n = len(nll)
      sid += 1
      out["nll"][i, o:o + n] = nll
      out["loss_mask"][i, o:o + n] = mask
      out["sample_ids"][i, o:o + n] = sid
      out["turn_ids"][i, o:o + n] = np.where(turn > 0, turn + tid, 0)
      tid += int(turn.max())
      o += n
    assert o <= seq_len
  return out


def _packed_and_unpacked(seed=0, n=12, seq_len=24):
  samples = _random_samples(np.random.default_rng(seed), n)
  unpacked = _layout(samples, [[j] for j in range(n)], seq_len)
  rows, used = [[]], 0
  for j, (nll, _, _) in enumerate(samples):  # next fit
    if used + len(nll) > seq_len:
      rows.append([])
      used = 0
    rows[-1].append(j)
    used += len(nll)
  packed = _layout(samples, rows, seq_len)
  assert len(rows) < n
  return packed, unpacked


def _loss(arrays, mode, divisor, gbs=None):
  return float(SFT_LOSSES[mode](arrays["nll"], arrays["loss_mask"], arrays["sample_ids"],
                                arrays["turn_ids"], divisor=divisor, gbs=gbs)[0])


@pytest.mark.parametrize("mode,divisor,gbs", [
    ("token_sum", "none", None),
    ("token_sum", "gbs", 16.0),
    ("global_token_mean", None, None),
    ("sample_mean", "none", None),
    ("sample_mean", "gbs_true", None),
    ("turn_mean", "none", None),
    ("turn_mean", "gbs_true", None),
])
def test_packed_equals_unpacked(mode, divisor, gbs):
  packed, unpacked = _packed_and_unpacked()
  np.testing.assert_allclose(_loss(packed, mode, divisor, gbs), _loss(unpacked, mode, divisor, gbs),
                             rtol=1e-6)


@pytest.mark.parametrize("mode,divisor", [
    ("row_mean", "none"), ("sample_mean", "gbs"), ("turn_mean", "gbs")])
def test_packed_differs_from_unpacked_for_row_mean_and_gbs_divisor(mode, divisor):
  packed, unpacked = _packed_and_unpacked()
  a, b = _loss(packed, mode, divisor), _loss(unpacked, mode, divisor)
  assert abs(a - b) > 0.2 * abs(b), (a, b)


def test_packed_row_mean_lets_long_sample_dominate():
  # A long sample (10 loss tokens, nll 1) and a short one (1 loss token, nll 5).
  long_mask = np.r_[0, np.ones(10)]
  samples = [(np.ones(11, np.float32), long_mask.astype(np.float32), long_mask.astype(np.int32)),
             (np.full(2, 5.0, np.float32), np.array([0, 1], np.float32), np.array([0, 1], np.int32))]
  unpacked = _layout(samples, [[0], [1]], 16)
  packed = _layout(samples, [[0, 1]], 16)
  np.testing.assert_allclose(_loss(unpacked, "row_mean", "gbs"), (1 + 5) / 2, rtol=1e-6)
  np.testing.assert_allclose(_loss(packed, "row_mean", "gbs"), (10 * 1 + 5) / 11, rtol=1e-6)
  for arrays in (packed, unpacked):  # the true-sample mean is the same in both layouts
    np.testing.assert_allclose(_loss(arrays, "sample_mean", "gbs_true"), 3.0, rtol=1e-6)


def test_gbs_divisor_rescales_by_rows_over_true_samples():
  packed, unpacked = _packed_and_unpacked()
  rows = packed["nll"].shape[0]
  true = _loss(packed, "sample_mean", "gbs_true")
  # /GBS counts packed rows, so it is the true-sample loss times (true samples / rows).
  np.testing.assert_allclose(_loss(packed, "sample_mean", "gbs"), true * 12 / rows, rtol=1e-6)
  np.testing.assert_allclose(_loss(unpacked, "sample_mean", "gbs"), true, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Split invariance: loss and gradient of a toy model for 1/2/4/8 devices x 1/2/4 micro-batches.

B, T, D, V = 32, 16, 4, 7
NUM_SEGMENTS = B * T + 1
CASES = [("token_sum", "none"), ("token_sum", "gbs"), ("global_token_mean", None),
         ("row_mean", "none"), ("row_mean", "gbs"),
         ("sample_mean", "none"), ("sample_mean", "gbs"), ("sample_mean", "gbs_true"),
         ("turn_mean", "none"), ("turn_mean", "gbs"), ("turn_mean", "gbs_true")]


@functools.lru_cache(maxsize=1)
def _toy_batch():
  rng = np.random.default_rng(1)
  samples = _random_samples(rng, 96, max_len=7)
  rows, used = [[] for _ in range(B)], [0] * B
  for j, (nll, _, _) in enumerate(samples):  # several samples per row
    r = int(np.argmin(used))
    if used[r] + len(nll) <= T:
      rows[r].append(j)
      used[r] += len(nll)
  arrays = _layout(samples, rows, T)
  x = rng.normal(size=(B, T, D)).astype(np.float32)
  y = rng.integers(0, V, size=(B, T)).astype(np.int32)
  w = rng.normal(size=(D, V)).astype(np.float32)
  return w, x, y, arrays["loss_mask"], arrays["sample_ids"], arrays["turn_ids"]


def _all_losses(w, x, y, mask, sids, tids, counts):
  """[len(CASES)] losses ``Σ weights · nll`` of the toy model ``nll = -log_softmax(x @ w)[y]``.

  Weights do not depend on ``w``, so they are computed once per case and the cases share one
  model graph (the losses' own ``Σ w · nll`` is checked against this in
  ``test_loss_functions_are_weighted_sums``).
  """
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x, w), axis=-1)
  nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]  # [B, T]
  weights = jnp.stack([sft_loss_weights(m, mask, sids, tids, divisor=d, global_counts=counts,
                                        num_segments=NUM_SEGMENTS) for m, d in CASES])  # [K, B, T]
  return jnp.einsum("kbt,bt->k", weights, nll)


@functools.lru_cache(maxsize=1)
def _reference():
  """One device, whole batch, counts taken from the arrays themselves."""
  w, x, y, mask, sids, tids = _toy_batch()
  f = lambda w: _all_losses(w, x, y, mask, sids, tids, None)  # noqa: E731
  return jax.jit(lambda w: (f(w), jax.jacrev(f)(w)))(w)


def _split_step(n_devices, n_micro):
  """Loss and jacobian with rows sharded over ``n_devices`` and ``n_micro`` micro-batches each."""
  mesh = make_mesh({"data": n_devices}, devices=jax.devices()[:n_devices])

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(),) + (P("data"),) * 5,
                     out_specs=(P(), P()))
  def step(w, x, y, mask, sids, tids):
    counts = sft_global_counts(mask, sids, tids, axis_name="data", num_segments=NUM_SEGMENTS)
    micro = [a.reshape(n_micro, -1, *a.shape[1:]) for a in (x, y, mask, sids, tids)]

    def accumulate(carry, mb):
      f = lambda w: _all_losses(w, *mb, counts)  # noqa: E731
      return jax.tree.map(jnp.add, carry, (f(w), jax.jacrev(f)(w))), None

    zeros = (jax.lax.pcast(jnp.zeros(len(CASES)), "data", to="varying"),
             jnp.zeros((len(CASES),) + w.shape))
    (loss, jac), _ = jax.lax.scan(accumulate, zeros, micro)
    # ``w`` is replicated (unvarying over "data"), so its gradient is already summed over the
    # axis by shard_map's transpose; only the loss needs a psum.
    return jax.lax.psum(loss, "data"), jac

  return step


@pytest.mark.parametrize("n_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_loss_and_grad_invariant_to_devices_and_micro_batches(n_devices, n_micro):
  ref_loss, ref_jac = _reference()
  loss, jac = _split_step(n_devices, n_micro)(*_toy_batch())
  for k, case in enumerate(CASES):
    np.testing.assert_allclose(loss[k], ref_loss[k], rtol=1e-5, err_msg=str(case))
    np.testing.assert_allclose(jac[k], ref_jac[k], rtol=1e-5, atol=1e-6, err_msg=str(case))


def test_psum_counts_equal_global_counts():
  _, _, _, mask, sids, tids = _toy_batch()
  mesh = make_mesh({"data": 8})
  f = jax.jit(jax.shard_map(
      lambda m, s, t: tuple(sft_global_counts(m, s, t, axis_name="data", num_segments=NUM_SEGMENTS)),
      mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P()))
  np.testing.assert_array_equal(f(mask, sids, tids), tuple(sft_global_counts(mask, sids, tids)))


def test_micro_batch_weights_are_slices_of_global_weights():
  _, _, _, mask, sids, tids = _toy_batch()

  @jax.jit
  def full_and_part(mask, sids, tids):
    counts = sft_global_counts(mask, sids, tids)
    return [(sft_loss_weights(m, mask, sids, tids, divisor=d, global_counts=counts)[8:16],
             sft_loss_weights(m, mask[8:16], sids[8:16], tids[8:16], divisor=d,
                              global_counts=counts, num_segments=NUM_SEGMENTS)) for m, d in CASES]

  for case, (full, part) in zip(CASES, full_and_part(mask, sids, tids)):
    np.testing.assert_allclose(part, full, rtol=1e-6, err_msg=str(case))


def test_toy_batch_exercises_packing():
  _, _, _, mask, sids, tids = _toy_batch()
  per_row = [len(set(r[r > 0])) for r in sids]
  assert max(per_row) >= 2 and min(per_row) >= 1
  assert len(set(tids[tids > 0])) > len(set(sids[sids > 0]))
  assert mask.sum() > 50


def test_loss_functions_are_weighted_sums():
  w, x, y, mask, sids, tids = _toy_batch()
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x, w), axis=-1)
  nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
  for k, (mode, divisor) in enumerate(CASES):
    loss, metrics = SFT_LOSSES[mode](nll, mask, sids, tids, divisor=divisor)
    np.testing.assert_allclose(loss, _reference()[0][k], rtol=1e-6, err_msg=mode)
    np.testing.assert_allclose(metrics["weight_sum"], jnp.sum(sft_loss_weights(
        mode, mask, sids, tids, divisor=divisor)), rtol=1e-6, err_msg=mode)
