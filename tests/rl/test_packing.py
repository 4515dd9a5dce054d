"""Token-budget micro-batching (AReaL Algorithm 1): placement invariants and split-invariant gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rl_testlib import TINY

from jaxrl import config as config_lib
from jaxrl import models, rl, sharding, train


def test_every_sequence_is_placed_once_within_the_budget():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 33, size=200)
  micro = rl.assign_micro_batches(lengths, row_len=32, rows=4)
  placed = sorted(i for mb in micro for row in mb for i in row)
  assert placed == list(range(200))
  for mb in micro:
    assert len(mb) == 4
    assert all(sum(lengths[i] for i in row) <= 32 for row in mb)
  # Longest-first placement wastes little: at most one micro-batch more than the token lower bound.
  assert len(micro) <= -(-lengths.sum() // 128) + 1


def test_micro_batches_are_balanced_and_opened_only_when_needed():
  micro = rl.assign_micro_batches([8, 8, 8, 8, 4, 4, 4, 4], row_len=8, rows=2)
  totals = [sum([8, 8, 8, 8, 4, 4, 4, 4][i] for row in mb for i in row) for mb in micro]
  assert totals == [16, 16, 16]  # a new micro-batch only when no row of an open one has room
  with pytest.raises(ValueError, match="row_len=8"):
    rl.assign_micro_batches([9], row_len=8, rows=2)


def test_packed_rows_carry_segments_positions_and_the_interleaved_layout():
  seqs = [{"tokens": np.full(n, n, np.int32), "targets": np.full(n, n, np.int32),
           "loss_mask": np.ones(n, np.float32), "advantages": np.ones(n, np.float32),
           "sampler_logprobs": np.zeros(n, np.float32), "group_ids": np.zeros(n, np.int32)} for n in (5, 3, 2, 6, 4)]
  pb = rl.pack_sequences(seqs, row_len=8, rows=2, bucket="pow2")
  assert pb.shape == (2, 2, 8) and pb.num_micro == 2 and pb.tokens == 20
  assert pb.assignment == [[[3], [0]], [[4, 1], [2]]]
  flat = pb.interleaved()
  for m in range(2):
    for r in range(2):
      np.testing.assert_array_equal(flat["tokens"][r * 2 + m], pb.arrays["tokens"][m, r])
  row = pb.arrays["segment_ids"][1, 0]
  tokens = pb.arrays["tokens"][1, 0]
  for seg in range(1, row.max() + 1):
    n = tokens[row == seg][0]
    assert (row == seg).sum() == n  # each segment is one whole sequence
    np.testing.assert_array_equal(pb.arrays["positions"][1, 0][row == seg], np.arange(n))
  assert row.max() == 2 and (row == 0).sum() == 1


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh({"data": -1})
  rules = sharding.LogicalRules.default()
  source = config_lib.from_dict(models.ModelSource, TINY)
  graphdef, params = nnx.split(source.build(mesh=mesh, rules=rules))
  rng = np.random.default_rng(1)
  n, groups = 24, 6
  prompts = tuple(rng.integers(6, 128, size=rng.integers(3, 10)).astype(np.int32) for _ in range(n))
  lengths = rng.integers(1, 13, size=n).astype(np.int32)
  tokens = rng.integers(6, 128, size=(n, 12)).astype(np.int32)
  rollout = rl.Rollout(
      prompt_ids=prompts, tokens=tokens, logprobs=(-4.8 + 0.3 * rng.standard_normal((n, 12))).astype(np.float32),
      lengths=lengths, truncated=lengths == 12, group_ids=np.repeat(np.arange(groups, dtype=np.int32), n // groups),
      rewards=rng.standard_normal(n).astype(np.float32), task_rewards=np.zeros(n, np.float32), texts=("",) * n)
  adv, _ = rl.compute_advantages(rollout, name="grpo", options={})
  seqs = rl.sequence_fields(rollout, adv, rl.loss_mask(rollout, overlong_filter=False))
  return mesh, graphdef, params, seqs, groups


_RUNS = {}


def _grads(setup, *, mode, row_len, rows, bucket):
  """Loss and gradient of the packed batch; the normaliser comes from ``prepare`` on the whole batch."""
  mesh, graphdef, params, seqs, groups = setup
  pb = rl.pack_sequences(seqs, row_len=row_len, rows=rows, bucket=bucket)
  arrays = dict(pb.arrays, mb_index=pb.arrays["mb_index"][..., None], old_logprobs=pb.arrays["sampler_logprobs"])
  m = pb.shape[0]
  bs = sharding.batch_sharding(mesh)
  flat = {k: jax.device_put(v, bs) for k, v in rl.PackedBatch(arrays, pb.num_micro, pb.tokens, []).interleaved().items()}
  batch = rl.make_prepare(rl.AlgorithmConfig(aggregation=mode), num_groups=groups, max_len=12)(flat)
  key = (m, row_len)
  if key not in _RUNS:  # one compilation per layout, shared by the aggregation modes
    loss_fn = rl.make_loss_fn(graphdef, rl.AlgorithmConfig(objective="clip_higher"), temperature=1.0, num_micro=m)
    _RUNS[key] = jax.jit(lambda p, b: train.accumulate_gradients(loss_fn, p, b, jnp.asarray(False),
                                                                  micro_batches=m, mesh=mesh))
  loss, grads, _ = _RUNS[key](params, batch)
  return pb.num_micro, float(loss), jax.tree.leaves(grads)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "prompt_mean"])
def test_token_budget_micro_batches_give_the_one_batch_gradient(setup, mode):
  m_small, loss_small, g_small = _grads(setup, mode=mode, row_len=24, rows=8, bucket="pow2")
  m_big, loss_big, g_big = _grads(setup, mode=mode, row_len=64, rows=8, bucket="exact")
  assert m_small >= 2 and m_big == 1
  np.testing.assert_allclose(loss_small, loss_big, rtol=1e-5)
  for a, b in zip(g_small, g_big):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  assert max(float(jnp.abs(g).max()) for g in g_big) > 1e-4  # a real gradient, not zeros


def test_decoupled_ppo_takes_the_sampler_as_behaviour_and_the_trainer_as_proximal(setup):
  mesh, graphdef, params, seqs, groups = setup
  pb = rl.pack_sequences(seqs, row_len=64, rows=8, bucket="exact")
  bs = sharding.batch_sharding(mesh)
  arrays = dict(pb.arrays, mb_index=pb.arrays["mb_index"][..., None])
  mb = {k: jax.device_put(v[0], bs) for k, v in arrays.items()}
  mb = rl.make_prepare(rl.AlgorithmConfig(), num_groups=groups, max_len=12)(mb)
  delta = 0.1 * np.asarray(mb["loss_mask"])

  def loss(objective, old):
    algo = rl.AlgorithmConfig(objective=objective, objective_kwargs={"epsilon_low": 0.2, "epsilon_high": 0.2})
    fn = jax.jit(rl.make_loss_fn(graphdef, algo, temperature=1.0, num_micro=1))
    return fn(params, dict(mb, old_logprobs=jax.device_put(old, bs)), jnp.asarray(False))

  same, _ = loss("decoupled_ppo", mb["sampler_logprobs"])
  clip, _ = loss("clip_higher", mb["sampler_logprobs"])
  np.testing.assert_allclose(float(same), float(clip), rtol=1e-6)
  _, metrics = loss("decoupled_ppo", np.asarray(mb["sampler_logprobs"]) + delta)
  weight = float(metrics["behav_weight_mean"]) / float(metrics["weight_sum"])
  np.testing.assert_allclose(weight, np.exp(0.1), rtol=1e-5)  # π_prox / π_behav, π_prox = the trainer's


def test_loss_column_capacity_rounds_to_an_eighth_of_the_row():
  assert rl.loss_column_capacity(16, 32) == 16  # granule 8
  assert rl.loss_column_capacity(64, 96) == 64  # granule 16
  assert rl.loss_column_capacity(65, 96) == 80
  assert rl.loss_column_capacity(90, 96) == 96  # no narrower than the row: the head runs on every column
  assert rl.loss_column_capacity(0, 32) == 8
  assert rl.loss_column_capacity(4097, 32768) == 8192  # at most 8 widths per row length


def test_the_head_on_loss_columns_only_gives_the_same_loss_gradient_and_logprobs(setup):
  """``with_loss_columns`` scores each row's loss tokens only (prompts never reach the head); the loss (PPO-clip,
  KL to a reference, entropy bonus), every metric, the gradient and the π_old/π_ref program's log-probs on the
  loss tokens are those of the head on every column, and the program's other columns are zero."""
  mesh, graphdef, params, seqs, groups = setup
  pb = rl.pack_sequences(seqs, row_len=64, rows=8, bucket="exact")
  mask = pb.arrays["loss_mask"] > 0  # [M, R, T]
  width = rl.loss_column_capacity(mask.sum(-1).max(), 64)
  assert width < 64 and mask.sum(-1).max() > 0
  narrow = rl.with_loss_columns(pb, width)
  cols = narrow.arrays["loss_columns"]
  assert cols.shape == (*mask.shape[:2], width)
  for m, r in np.ndindex(*mask.shape[:2]):
    n = mask[m, r].sum()
    np.testing.assert_array_equal(cols[m, r, :n], np.flatnonzero(mask[m, r]))
    assert (cols[m, r, n:] == 64).all()  # padding: out of range, dropped by the scatter
  with pytest.raises(ValueError, match="loss tokens, more than width"):
    rl.with_loss_columns(pb, int(mask.sum(-1).max()) - 1)

  bs = sharding.batch_sharding(mesh)
  rng = np.random.default_rng(3)
  noise = (0.05 * rng.standard_normal(mask.shape[1:])).astype(np.float32)
  algo = rl.AlgorithmConfig(objective="clip_higher", kl_coef=0.1, entropy_coef=0.01)

  def run(packed):
    arrays = dict(packed.arrays, mb_index=packed.arrays["mb_index"][..., None])
    mb = {k: jax.device_put(v[0], bs) for k, v in arrays.items()}
    lp = np.asarray(mb["sampler_logprobs"])
    mb = dict(mb, old_logprobs=jax.device_put(lp + noise * mask[0], bs),
              ref_logprobs=jax.device_put(lp - noise * mask[0], bs))
    mb = rl.make_prepare(algo, num_groups=groups, max_len=12)(mb)
    loss_fn = rl.make_loss_fn(graphdef, algo, temperature=0.9, num_micro=1)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, mb, jnp.asarray(False))
    logp = rl.make_logprob_fn(graphdef, temperature=0.9, chunk_size=64)(params, mb)
    return float(loss), jax.tree.map(np.asarray, metrics), jax.tree.leaves(grads), np.asarray(logp)

  loss_all, metrics_all, grads_all, logp_all = run(pb)
  loss_cols, metrics_cols, grads_cols, logp_cols = run(narrow)
  np.testing.assert_allclose(loss_cols, loss_all, rtol=1e-5)
  assert metrics_cols.keys() == metrics_all.keys()
  for k in metrics_all:
    np.testing.assert_allclose(metrics_cols[k], metrics_all[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for a, b in zip(grads_cols, grads_all):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  assert max(float(np.abs(g).max()) for g in grads_all) > 1e-4  # a real gradient, not zeros
  np.testing.assert_allclose(logp_cols[mask[0]], logp_all[mask[0]], rtol=1e-5)
  assert (logp_cols[~mask[0]] == 0).all() and (logp_all[~mask[0]] != 0).any()
