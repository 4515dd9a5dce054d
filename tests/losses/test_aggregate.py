"""Aggregation weights: float64 references, hand examples, packing, and split invariance on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.losses._aggregate import AGGREGATION_MODES, aggregate, global_counts, loss_weights
from jaxrl.losses._policy import OBJECTIVES
from jaxrl.sharding import make_mesh


def np_loss_weights(mask, mode, group_ids=None, max_len=None):
  """Independent float64 reference of every aggregation mode."""
  mask = np.asarray(mask, np.float64)
  lengths = mask.sum(-1)
  n_seq = np.sum(lengths > 0)
  if mode == "token_mean":
    return mask / mask.sum()
  if mode == "seq_mean_token_mean":
    return mask / np.maximum(lengths, 1)[:, None] / n_seq
  if mode == "seq_mean_token_sum":
    return mask / n_seq
  if mode == "seq_mean_token_sum_norm":
    return mask / n_seq / max_len
  groups = {g: mask[group_ids == g].sum() for g in np.unique(group_ids)}
  n_grp = sum(1 for v in groups.values() if v > 0)
  denom = np.array([groups[g] for g in group_ids])
  return mask / np.maximum(denom, 1)[:, None] / n_grp


def _random_mask(rng, b, t):
  mask = (rng.uniform(size=(b, t)) > 0.3).astype(np.float32)
  mask[:, 0] = 1.0
  mask[2] = 0.0  # an empty response
  return mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_loss_weights_match_float64_numpy(mode):
  rng = np.random.default_rng(0)
  b, t = 12, 7
  mask = _random_mask(rng, b, t)
  gid = rng.permutation(np.repeat(np.arange(4), 3))
  w = loss_weights(jnp.asarray(mask), mode=mode, group_ids=jnp.asarray(gid), num_groups=4, max_len=10)
  np.testing.assert_allclose(np.asarray(w), np_loss_weights(mask, mode, gid, 10), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode,expected", [
    ("token_mean", [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]),
    ("seq_mean_token_mean", [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]]),
    ("seq_mean_token_sum", [[1 / 2, 1 / 2, 0], [1 / 2, 0, 0]]),
    ("seq_mean_token_sum_norm", [[1 / 8, 1 / 8, 0], [1 / 8, 0, 0]]),
    ("prompt_mean", [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]]),
])
def test_loss_weights_hand_example(mode, expected):
  mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  w = loss_weights(mask, mode=mode, group_ids=jnp.asarray([0, 1]), num_groups=2, max_len=4)
  np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-6)


def test_prompt_mean_pools_tokens_within_a_prompt():
  # One prompt, responses of 3 and 1 tokens: every token weighs 1/4 (pooled), unlike seq_mean (1/6, 1/2).
  mask = jnp.asarray([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
  w = loss_weights(mask, mode="prompt_mean", group_ids=jnp.asarray([5, 5]), num_groups=8)
  np.testing.assert_allclose(np.asarray(w), [[0.25] * 3, [0.25, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_packed_rows_equal_unpacked_rows(mode):
  rng = np.random.default_rng(1)
  t = 6
  mask = _random_mask(rng, 8, t)
  gid = np.repeat(np.arange(4), 2)
  unpacked = np.asarray(loss_weights(jnp.asarray(mask), mode=mode, group_ids=jnp.asarray(gid), num_groups=4,
                                     max_len=t))
  packed_mask = mask.reshape(4, 2 * t)
  seg = np.tile(np.repeat([1, 2], t), (4, 1))
  packed_gid = np.repeat(gid, t).reshape(4, 2 * t)
  packed = loss_weights(jnp.asarray(packed_mask), mode=mode, group_ids=jnp.asarray(packed_gid), num_groups=4,
                        segment_ids=jnp.asarray(seg), max_len=t)
  np.testing.assert_allclose(np.asarray(packed), unpacked.reshape(4, 2 * t), rtol=1e-6)


def test_aggregate_is_weighted_sum_and_ignores_masked_nan():
  rng = np.random.default_rng(2)
  mask = _random_mask(rng, 6, 5)
  values = rng.normal(size=(6, 5)).astype(np.float32)
  values_nan = np.where(mask > 0, values, np.nan)
  for mode in AGGREGATION_MODES:
    gid = jnp.arange(6) // 2
    out = aggregate(jnp.asarray(values_nan), jnp.asarray(mask), mode=mode, group_ids=gid, num_groups=3, max_len=5)
    expected = np.sum(np_loss_weights(mask, mode, np.arange(6) // 2, 5) * values)
    np.testing.assert_allclose(float(out), expected, rtol=1e-5)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_mask_gives_zero_weights(mode):
  w = loss_weights(jnp.zeros((3, 4)), mode=mode, group_ids=jnp.arange(3), num_groups=3, max_len=4)
  assert bool(jnp.all(w == 0))


def test_invalid_arguments_raise():
  mask = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="unknown aggregation mode"):
    loss_weights(mask, mode="mean")
  with pytest.raises(ValueError, match="group_ids"):
    loss_weights(mask, mode="prompt_mean")
  with pytest.raises(ValueError, match="num_groups"):
    loss_weights(mask, mode="prompt_mean", group_ids=jnp.arange(2))
  with pytest.raises(ValueError, match="max_len"):
    loss_weights(mask, mode="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="not both"):
    loss_weights(mask, mode="token_mean", global_counts=global_counts(mask), axis_name="data")


def test_global_counts_hand_example():
  mask = jnp.asarray([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
  gc = global_counts(mask, group_ids=jnp.asarray([0, 1, 3]), num_groups=4)
  assert int(gc.tokens) == 3 and int(gc.sequences) == 2 and int(gc.groups) == 2
  np.testing.assert_array_equal(np.asarray(gc.group_tokens), [2, 0, 0, 1])


# ------------------------------------------------------------------------------------------------
# Split invariance: devices × micro-batches, every mode, both count sources.

GB, GT, NG = 32, 8, 8


def _global_batch():
  rng = np.random.default_rng(3)
  lp = -rng.uniform(0.05, 3.0, (GB, GT))
  old = lp + rng.normal(0, 0.3, (GB, GT))
  adv = rng.normal(size=(GB, GT))
  mask = (rng.uniform(size=(GB, GT)) > 0.3).astype(np.float64)
  mask[:, 0] = 1.0
  mask[5] = 0.0
  gid = rng.permutation(np.repeat(np.arange(NG), GB // NG))  # groups spread over shards and micro-batches
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(lp), f32(old), f32(adv), f32(mask), jnp.asarray(gid, jnp.int32)


def _micro_loss_and_grad(lp, old, adv, w):
  def f(x):
    return OBJECTIVES["ppo_clip"](logprobs=x, old_logprobs=old, advantages=adv, loss_weights=w)

  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(lp)
  return loss, metrics["clip_frac"], g


@pytest.fixture(scope="module")
def unsplit():
  lp, old, adv, mask, gid = _global_batch()
  step = jax.jit(_micro_loss_and_grad)
  out = {}
  for mode in AGGREGATION_MODES:
    w = loss_weights(mask, mode=mode, group_ids=gid, num_groups=NG, max_len=GT)
    out[mode] = jax.tree.map(np.asarray, step(lp, old, adv, w))
  return out


@pytest.mark.parametrize("n_micro", [1, 2, 4])
@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
def test_split_invariance_across_devices_and_micro_batches(n_dev, n_micro, unsplit):
  lp, old, adv, mask, gid = _global_batch()
  mesh = make_mesh({"data": n_dev}, devices=jax.devices()[:n_dev])
  gc = global_counts(mask, group_ids=gid, num_groups=NG)  # once, on the global batch
  mb = GB // n_dev // n_micro
  n_modes = len(AGGREGATION_MODES)

  def per_device(lp, old, adv, mask, gid, gc):
    # Source "axis_name": weights for the whole local shard (psum over devices), then sliced.
    full = jnp.stack([loss_weights(mask, mode=m, group_ids=gid, num_groups=NG, max_len=GT, axis_name="data")
                      for m in AGGREGATION_MODES])  # [modes, local, T]
    full = jnp.moveaxis(full.reshape(n_modes, n_micro, mb, GT), 1, 0)  # [micro, modes, mb, T]
    split = lambda x: x.reshape(n_micro, mb, *x.shape[1:])

    def micro_step(_, xs):
      lp_m, old_m, adv_m, mask_m, gid_m, full_m = xs
      # Source "global_counts": weights per micro-batch from the precomputed global counts.
      w_gc = jnp.stack([loss_weights(mask_m, mode=m, group_ids=gid_m, max_len=GT, global_counts=gc)
                        for m in AGGREGATION_MODES])
      w = jnp.concatenate([w_gc, full_m])  # [2·modes, mb, T]
      loss, clip, grad = jax.vmap(_micro_loss_and_grad, in_axes=(None, None, None, 0))(lp_m, old_m, adv_m, w)
      return None, (loss, clip, grad)

    _, (loss, clip, grads) = jax.lax.scan(micro_step, None,
                                          (split(lp), split(old), split(adv), split(mask), split(gid), full))
    grads = jnp.moveaxis(grads, 1, 0).reshape(2 * n_modes, n_micro * mb, GT)
    # Sum of the micro-batch losses, then over devices.
    return jax.lax.psum(loss.sum(0), "data"), jax.lax.psum(clip.sum(0), "data"), grads

  data = P("data")
  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(data, data, data, data, data, P()),
                             out_specs=(P(), P(), P(None, "data"))))
  loss, clip, grad = jax.tree.map(np.asarray, fn(lp, old, adv, mask, gid, gc))
  for i, (source, mode) in enumerate((s, m) for s in ("global_counts", "axis_name") for m in AGGREGATION_MODES):
    ref_loss, ref_clip, ref_grad = unsplit[mode]
    msg = f"mode={mode} source={source}"
    np.testing.assert_allclose(loss[i], ref_loss, rtol=1e-5, atol=1e-7, err_msg=msg)
    np.testing.assert_allclose(clip[i], ref_clip, rtol=1e-5, atol=1e-7, err_msg=msg)
    np.testing.assert_allclose(grad[i], ref_grad, rtol=1e-6, atol=1e-9, err_msg=msg)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_global_sequence_count_matches_a_loop_over_packed_segments(seed):
  rng = np.random.default_rng(seed)
  b, t = 6, 24
  seg = np.zeros((b, t), np.int32)
  for r in range(b):  # contiguous runs 1, 2, ... then padding (0)
    cuts = np.sort(rng.choice(np.arange(1, t), size=rng.integers(1, 5), replace=False))
    for i, (lo, hi) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, t])):
      seg[r, lo:hi] = i + 1 if hi < t or rng.random() < 0.5 else 0
  mask = (rng.random((b, t)) < 0.3) & (seg > 0)  # gaps inside segments, some segments empty
  want = sum(int(mask[r][seg[r] == s].any()) for r in range(b) for s in set(seg[r].tolist()) - {0})
  gc = global_counts(jnp.asarray(mask, jnp.float32), segment_ids=jnp.asarray(seg))
  assert int(gc.sequences) == want and 0 < want < int((seg.max(1)).sum())
  assert int(global_counts(jnp.asarray(mask, jnp.float32)).sequences) == int(mask.any(1).sum())
