"""PPO with a critic: GAE from the value model's packed values, critic updates, checkpoints, config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rl_testlib import make_config

from jaxrl import config as config_lib
from jaxrl import rl, sharding
from jaxrl.rl import _critic
from jaxrl.rl._packing import pack_sequences

GAMMA, LAM = 0.9, 0.8


def _np_gae(rewards, mask, values, *, gamma, lam, token_rewards=None, finished=None, boot=None):
  """float64 reference: per sample, a reverse loop over its (contiguous) response tokens."""
  n, length = mask.shape
  adv = np.zeros((n, length))
  for i in range(n):
    idx = np.flatnonzero(mask[i] > 0)
    done = True if finished is None else bool(finished[i])
    r = np.zeros(length) if token_rewards is None else np.asarray(token_rewards[i], np.float64).copy()
    if done:
      r[idx[-1]] += rewards[i]
    next_v, a = (0.0 if done else float(boot[i])), 0.0
    for t in idx[::-1]:
      a = r[t] + gamma * next_v - values[i, t] + gamma * lam * a
      adv[i, t], next_v = a, values[i, t]
  return adv, np.where(mask > 0, adv + values, 0.0)


def _rollout(n=24, length=5, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, length + 1, size=n).astype(np.int32)
  rewards = rng.integers(0, 2, size=n).astype(np.float32)
  return rl.Rollout(
      prompt_ids=tuple(rng.integers(3, 120, size=int(p)).astype(np.int32) for p in rng.integers(2, 4, size=n)),
      tokens=rng.integers(3, 120, size=(n, length)).astype(np.int32), logprobs=np.full((n, length), -1.0, np.float32),
      lengths=lengths, truncated=lengths == length, group_ids=np.repeat(np.arange(n // 4, dtype=np.int32), 4),
      rewards=rewards, task_rewards=rewards, texts=("",) * n)


@pytest.fixture(scope="module")
def critic_setup(tmp_path_factory):
  cfg = make_config(tmp_path_factory.mktemp("critic"), **{
      "algorithm.advantage": "gae", "algorithm.advantage_kwargs": {"gamma": GAMMA, "lam": LAM},
      "critic": {"whiten_advantages": False, "optim": {"lr": 3e-3}}})
  mesh, rules = cfg.mesh.build(), cfg.mesh.logical_rules()
  critic = _critic.Critic(cfg, mesh=mesh, rules=rules, batch_sharding=sharding.batch_sharding(mesh, rules))
  vm = nnx.merge(critic.graphdef, critic.state.params)  # a non-zero head, so values vary per token
  vm.value_head[...] = jnp.asarray(np.random.default_rng(1).normal(size=vm.value_head.shape), jnp.float32)
  vm.value_bias[...] = jnp.asarray(0.3, jnp.float32)
  critic.state = critic.state._replace(params=nnx.split(vm)[1])
  return cfg, critic, vm, mesh, rules


def _packed_batch(critic, ro, mesh, rules):
  seqs = rl.sequence_fields(ro, np.zeros(ro.tokens.shape, np.float32), ro.response_mask())
  pb = pack_sequences(seqs, row_len=8, rows=8, bucket="exact")
  assert pb.shape[0] > 1, "the rollout must fill several micro-batches (interleaved rows)"
  pb.arrays["mb_index"] = pb.arrays["mb_index"][..., None]
  critic.note(pb, range(ro.num_samples), ro)
  put = lambda a: sharding.global_batch(a, sharding.batch_sharding(mesh, rules))
  batch = {k: put(v) for k, v in pb.interleaved().items()}
  return pb, batch, put


def test_gae_from_packed_critic_values_matches_float64_numpy_gae(critic_setup):
  _, critic, vm, mesh, rules = critic_setup
  ro = _rollout()
  pb, batch, put = _packed_batch(critic, ro, mesh, rules)
  metrics = critic.fill(ro, [pb], [batch], put)
  # Reference values: each sample alone in its own unpacked row, V(s_t) at the position predicting token t.
  values = np.zeros(ro.tokens.shape)
  for i in range(ro.num_samples):
    p, n = len(ro.prompt_ids[i]), int(ro.lengths[i])
    seq = np.concatenate([ro.prompt_ids[i], ro.tokens[i, :n]])[None, :-1]
    v = vm(jnp.asarray(seq), positions=jnp.arange(seq.shape[1])[None], segment_ids=jnp.ones_like(seq))
    values[i, :n] = np.asarray(v, np.float64)[0, p - 1:p - 1 + n]
  mask = ro.response_mask()
  want_adv, want_ret = _np_gae(ro.rewards.astype(np.float64), mask, values, gamma=GAMMA, lam=LAM)
  rmap = _critic.response_map(pb.assignment, range(ro.num_samples), lengths=ro.lengths, shape=pb.shape,
                              prompt_lens=np.asarray([len(p) for p in ro.prompt_ids]))
  got = {k: np.zeros(ro.tokens.shape, np.float32) for k in ("advantages", "returns", "old_values")}
  for k in got:
    rmap.gather(np.asarray(jax.device_get(batch[k])), got[k])
  np.testing.assert_allclose(got["old_values"], values * mask, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["advantages"], want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["returns"], want_ret, rtol=1e-5, atol=1e-5)
  ev = 1 - np.var((want_ret - values)[mask > 0]) / np.var(want_ret[mask > 0])
  np.testing.assert_allclose(metrics["critic/explained_variance"], ev, rtol=1e-4)
  # Nothing is written outside response tokens.
  resp = np.zeros((pb.shape[1], pb.shape[0], pb.shape[2]), bool)  # [R, M, T]: interleaved rows
  resp[rmap.row, rmap.micro, rmap.col] = True
  assert not np.asarray(jax.device_get(batch["returns"])).reshape(resp.shape)[~resp].any()


def test_kl_reward_enters_gae_per_loss_token(critic_setup):
  """``critic.kl_reward_coef``: r_t = -β·k1(π_old, π_ref) on loss tokens, before GAE."""
  _, critic, _, mesh, rules = critic_setup
  ro = _rollout(seed=7)
  pb, batch, put = _packed_batch(critic, ro, mesh, rules)
  rmap = critic._maps[id(pb)]
  rng = np.random.default_rng(8)
  loss_mask = ro.response_mask() * (rng.random(ro.tokens.shape) < 0.8)  # e.g. overlong-filtered tokens
  old, ref = (-rng.random(ro.tokens.shape) * loss_mask for _ in range(2))
  batch.update(loss_mask=put(rmap.scatter(loss_mask)), old_logprobs=put(rmap.scatter(old)),
               ref_logprobs=put(rmap.scatter(ref)))
  plain = critic.ccfg
  critic.ccfg = dataclasses.replace(plain, kl_reward_coef=0.5)
  try:
    metrics = critic.fill(ro, [pb], [batch], put)
  finally:
    critic.ccfg = plain
  got = {k: np.zeros(ro.tokens.shape, np.float32) for k in ("advantages", "old_values")}
  for k in got:
    rmap.gather(np.asarray(jax.device_get(batch[k])), got[k])
  dense = -0.5 * (old - ref) * loss_mask
  want, _ = _np_gae(ro.rewards.astype(np.float64), ro.response_mask(), got["old_values"].astype(np.float64),
                    gamma=GAMMA, lam=LAM, token_rewards=dense)
  np.testing.assert_allclose(got["advantages"], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics["critic/kl_reward"], ((old - ref) * loss_mask).sum() / loss_mask.sum(), rtol=1e-5)


def test_dense_kl_rewards_egae_and_whitening_match_numpy():
  ro = _rollout(seed=2)
  mask = ro.response_mask()
  rng = np.random.default_rng(4)
  values = rng.normal(size=mask.shape) * mask
  dense = -0.05 * rng.random(mask.shape) * mask
  common = dict(options={"gamma": GAMMA, "lam": LAM}, rewards=ro.rewards, response_mask=mask, values=values,
                truncated=ro.truncated, token_rewards=dense)
  adv, ret, _ = _critic.gae_advantages(name="gae", **common)
  want_adv, want_ret = _np_gae(ro.rewards, mask, values, gamma=GAMMA, lam=LAM, token_rewards=dense)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-6)
  assert ro.truncated.any() and not ro.truncated.all()
  last = ro.lengths - 1
  adv, ret, _ = _critic.gae_advantages(name="egae", **common)
  want_adv, want_ret = _np_gae(ro.rewards, mask, values, gamma=GAMMA, lam=LAM, token_rewards=dense,
                               finished=~ro.truncated, boot=values[np.arange(len(last)), last])
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-6)
  white, ret_w, _ = _critic.gae_advantages(name="egae", whiten=True, **common)
  m = mask > 0
  np.testing.assert_allclose(white[m], (want_adv[m] - want_adv[m].mean()) / (want_adv[m].std() + 1e-8), rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(ret_w, want_ret, rtol=1e-5, atol=1e-6)  # targets are not whitened


def test_critic_updates_reduce_the_value_loss_on_a_fixed_batch(critic_setup):
  cfg, critic, _, mesh, rules = critic_setup
  ro = _rollout(seed=5)
  pb, batch, put = _packed_batch(critic, ro, mesh, rules)
  critic.fill(ro, [pb], [batch], put)
  batch["loss_mask"] = put(pb.interleaved()["loss_mask"])
  before = jax.device_get(critic.state.params)  # the step donates the state
  losses_seen = []
  for _ in range(4):
    critic.train(batch, pb.shape[0], cfg.rollout.max_new_tokens)
    out = jax.device_get(critic._raw[-1])
    losses_seen.append(float(out["value_loss"]) / float(out["weight_sum"]))
  metrics = critic.metrics()
  assert losses_seen[-1] < losses_seen[0] and metrics["critic/value_loss"] > 0, losses_seen
  assert 0.0 <= metrics["critic/value_clip_frac"] <= 1.0
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(before),
                               jax.tree_util.tree_leaves_with_path(critic.state.params)):
    assert not np.array_equal(np.asarray(a), np.asarray(b)), f"critic parameter {jax.tree_util.keystr(path)} unchanged"


def test_one_ppo_step_trains_the_critic_logs_it_and_checkpoints_it(tmp_path):
  cfg = make_config(tmp_path, **{"algorithm.advantage": "gae", "critic": {"optim": {"lr": 1e-3}},
                                 "steps": 1, "checkpoint": {"every": 1}})
  trainer = rl.RLTrainer(cfg)
  before = jax.device_get(trainer.critic.state.params)
  try:
    trainer.run()
  finally:
    trainer.close()
  h = trainer.history[-1]
  for key in ("critic/value_loss", "critic/value_clip_frac", "critic/explained_variance", "advantage/abs_mean"):
    assert np.isfinite(h[key]), key
  assert h["critic/value_loss"] > 0 and h["advantage/abs_mean"] > 0
  after = jax.device_get(trainer.critic.state.params)
  assert int(trainer.critic.state.step) == cfg.updates_per_step
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
  assert all(changed), "every critic parameter moves in two updates (the zero head lets the trunk move from the 2nd)"
  # Resume: a new trainer restores the critic's parameters and optimizer state with the actor's.
  again = rl.RLTrainer(cfg)
  try:
    assert again._restore() == 1
  finally:
    again.close()
  for a, b in zip(jax.tree.leaves(jax.device_get(trainer.critic.state)), jax.tree.leaves(jax.device_get(again.critic.state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("over, message", [
    ({"algorithm.advantage": "gae"}, r"algorithm\.advantage: 'gae' needs a value model.*add a `critic:` section"),
    ({"algorithm.advantage": "egae"}, r"'egae' needs a value model.*add a `critic:` section"),
    ({"algorithm.advantage": "gae", "critic": {"valu_clip": 0.2}}, r"unknown config key 'critic\.valu_clip'"),
    ({"algorithm.advantage": "gae", "critic": {"value_clip": 0}}, r"critic\.value_clip must be > 0"),
    ({"algorithm.advantage": "gae", "critic": {"kl_reward_estimator": "k9"}}, r"critic\.kl_reward_estimator"),
    ({"algorithm.advantage": "gae", "critic": {}, "algorithm.advantage_kwargs": {"values": 1}},
     r"algorithm\.advantage_kwargs\.values"),
    ({"algorithm.advantage": "gae", "critic": {}, "algorithm.advantage_kwargs": {"lamda": 0.9}},
     r"unknown config key 'algorithm\.advantage_kwargs\.lamda'"),
    ({"critic": {}}, r"critic: set, but algorithm\.advantage 'grpo' does not use values"),
    ({"algorithm.advantage": "remax", "critic": {}}, "baseline_rewards"),
    ({"algorithm.advantage": "seed_grpo", "critic": {}}, "semantic_entropy or cluster_ids"),
    ({"algorithm.advantage": "arpo_hard", "critic": {}}, "prefix_ids"),
])
def test_critic_config_errors_name_the_key(tmp_path, over, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    make_config(tmp_path, **over)


def test_egae_with_a_critic_loads(tmp_path):
  cfg = make_config(tmp_path, **{"algorithm.advantage": "egae", "critic": {"value_clip": None}})
  assert cfg.critic.value_clip is None and cfg.algorithm.advantage == "egae"
