"""``reward.implicit_prm``: a DPO policy and its reference score the sampled token ids; their step rewards are a dense
reward (PRIME's process advantage without a critic, GAE token rewards with one), checked against float64 numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rl_testlib import TINY, make_config

from jaxrl import data as data_lib
from jaxrl import models, rl
from jaxrl.rl import _critic
from jaxrl.rl import _prm as rl_prm
from jaxrl.rl import _trainer as trainer_mod

BETA, COEF = 0.5, 0.7


@pytest.fixture(scope="module")
def prm_dirs(tmp_path_factory):
  """``(policy dir, reference dir, policy, reference)``: a tiny random reference and a perturbed copy of it."""
  tok = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  reference = models.ModelSource(**dict(TINY, seed=5)).build()
  graphdef, state = nnx.split(reference)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  policy = nnx.merge(graphdef, jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                                         for x, k in zip(leaves, keys)]))
  root = tmp_path_factory.mktemp("prm")
  models.save_pretrained(policy, root / "policy", tokenizer=tok)
  models.save_pretrained(reference, root / "reference", tokenizer=tok)
  return str(root / "policy"), str(root / "reference"), policy, reference


def _prm_config(tmp_path, prm_dirs, **over):
  prm = {"policy": prm_dirs[0], "reference": prm_dirs[1], "beta": BETA, "coef": COEF, "rows": 8, "seq_len": 48}
  return make_config(tmp_path, **{"reward.implicit_prm": prm, "steps": 1, "algorithm.mini_batches": 1, **over})


def _np_q(policy, reference, prompt, completion):
  """β (log π − log π_ref) of each completion token, float64, each model alone on the unpacked sequence."""
  ids = np.concatenate([prompt, completion]).astype(np.int32)
  out = []
  for m in (policy, reference):
    tok = jnp.asarray(ids)[None]
    z = np.asarray(m(tok, positions=jnp.arange(len(ids))[None], segment_ids=jnp.ones_like(tok)), np.float64)[0]
    z = z - z.max(-1, keepdims=True)
    lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    out.append(lsm[np.arange(len(ids) - 1), ids[1:]][len(prompt) - 1:])
  return BETA * (out[0] - out[1])


def _np_dense(q, ids, newline_id):
  """Step sums at each step's last token: the tiny tokenizer has one token per character, so a step ends at each
  newline token and at the last token."""
  dense, acc = np.zeros(len(q)), 0.0
  for t, (qt, i) in enumerate(zip(q, ids)):
    acc += qt
    if i == newline_id or t == len(q) - 1:
      dense[t], acc = acc, 0.0
  return dense


def _np_rloo_plus_prime(rewards, dense, lengths, groups, coef):
  """RLOO of the outcome on every token + coef × PRIME's return-to-go of the LOO-baselined dense rewards."""
  adv = np.zeros(dense.shape)
  for g in np.unique(groups):
    members = np.flatnonzero(groups == g)
    k = len(members)
    means = [dense[i, :lengths[i]].mean() if lengths[i] else 0.0 for i in members]
    for i in members:
      n = lengths[i]
      outcome = rewards[i] - np.mean([rewards[j] for j in members if j != i])
      tilde = dense[i, :n] * k / (k - 1) - sum(means) / (k - 1)
      adv[i, :n] = outcome + coef * np.cumsum(tilde[::-1])[::-1]
  return adv


def _capture(monkeypatch, module, name):
  """Records every call's (args, kwargs, result) of ``module.name``."""
  calls, fn = [], getattr(module, name)

  def wrapped(*a, **kw):
    out = fn(*a, **kw)
    calls.append((a, kw, out))
    return out
  monkeypatch.setattr(module, name, wrapped)
  return calls


def test_rloo_step_advantages_equal_rloo_plus_prime_from_the_sampled_ids(tmp_path, prm_dirs, monkeypatch):
  """An RLOO step's rollout and advantages (the update itself runs in the critic test): the PRM scored the
  rollout's own token ids (float64 numpy of separate forwards), and the advantages the trainer packed equal RLOO's
  outcome term + coef × PRIME's process term recomputed by hand from the logged task and step rewards; then a
  hand-made rollout with several newline-separated steps per response."""
  cfg = _prm_config(tmp_path, prm_dirs, **{"algorithm.advantage": "rloo"})
  fields = _capture(monkeypatch, trainer_mod, "sequence_fields")
  trainer = rl.RLTrainer(cfg)
  try:
    ro, _ = trainer.collect(1)  # step 1's rollout, scored by the task reward
    _, metrics = trainer.pack(ro, 1)  # its advantages and packed micro-batches
  finally:
    trainer.close()
  got = fields[-1][0][1]  # sequence_fields(rollout, advantages [N, L], mask)
  newline = trainer.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
  dense = np.zeros(ro.tokens.shape)
  for i, n in enumerate(ro.lengths):
    q = _np_q(prm_dirs[2], prm_dirs[3], ro.prompt_ids[i], ro.tokens[i, :n])
    np.testing.assert_allclose(trainer.last_prm["token_rewards"][i], q, rtol=1e-4, atol=1e-5)
    dense[i, :n] = _np_dense(q, ro.tokens[i, :n], newline)
  np.testing.assert_allclose(trainer.last_prm["dense"], dense, rtol=1e-4, atol=1e-5)
  want = _np_rloo_plus_prime(ro.rewards.astype(np.float64), dense, ro.lengths, ro.group_ids, COEF)
  assert np.abs(want).max() > 1e-2
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  sums = [dense[i].sum() for i in range(ro.num_samples)]
  mins = [min(r) for r in trainer.last_prm["step_rewards"]]
  np.testing.assert_allclose(metrics["reward/prm_mean"], np.mean(sums), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["reward/prm_min_step"], np.mean(mins), rtol=1e-4, atol=1e-6)

  # Hand-made rollout (2 groups of 3): responses of up to 4 steps, so the step split is exercised for sure.
  rng = np.random.default_rng(0)
  texts = ["1\n2\n3", "ab\n\ncd", "7", "x\ny", "\n\n\n", "42\n"]
  comp = [np.asarray(trainer.tokenizer(t, add_special_tokens=False)["input_ids"], np.int32) for t in texts]
  width = max(len(c) for c in comp)
  hand = rl.Rollout(prompt_ids=tuple(rng.integers(3, 100, size=5).astype(np.int32) for _ in texts),
                    tokens=np.stack([np.pad(c, (0, width - len(c))) for c in comp]),
                    logprobs=np.zeros((6, width), np.float32), lengths=np.asarray([len(c) for c in comp], np.int32),
                    truncated=np.zeros(6, bool), group_ids=np.asarray([0, 0, 0, 1, 1, 1], np.int32),
                    rewards=np.asarray([1, 0, 0.5, 0, 0, 1], np.float32),
                    task_rewards=np.zeros(6, np.float32), texts=tuple(texts))
  trainer.pack(hand, 1)
  dense = np.zeros(hand.tokens.shape)
  for i, c in enumerate(comp):
    dense[i, :len(c)] = _np_dense(_np_q(prm_dirs[2], prm_dirs[3], hand.prompt_ids[i], c), c, newline)
  assert [len(r) for r in trainer.last_prm["step_rewards"]] == [3, 3, 1, 2, 3, 1]  # a final newline ends the last step
  want = _np_rloo_plus_prime(hand.rewards.astype(np.float64), dense, hand.lengths, hand.group_ids, COEF)
  np.testing.assert_allclose(fields[-1][0][1], want, rtol=1e-4, atol=1e-4)


def test_with_a_critic_the_step_rewards_enter_gae_as_token_rewards(tmp_path, prm_dirs, monkeypatch):
  """GAE (no whitening, γ = 0.9, λ = 0.8): GAE's token rewards are coef × the step rewards at each step's last
  token (token granularity here: step_delimiter null), and its advantages are numpy GAE of them."""
  cfg = _prm_config(tmp_path, prm_dirs, **{
      "algorithm.advantage": "gae", "algorithm.advantage_kwargs": {"gamma": 0.9, "lam": 0.8},
      "critic": {"whiten_advantages": False}, "reward.implicit_prm.step_delimiter": None})
  calls = _capture(monkeypatch, _critic, "gae_advantages")
  trainer = rl.RLTrainer(cfg)
  try:
    trainer.run()
  finally:
    trainer.close()
  kw, (adv, _, _) = calls[-1][1], calls[-1][2]
  q = trainer.last_prm["token_rewards"]
  dense = np.zeros(kw["values"].shape)
  for i, qi in enumerate(q):
    dense[i, :len(qi)] = qi  # every token is a step
  np.testing.assert_allclose(kw["token_rewards"], COEF * dense, rtol=1e-6, atol=1e-7)
  assert np.abs(dense).max() > 1e-2
  mask, values = kw["response_mask"], np.asarray(kw["values"], np.float64)
  want = np.zeros(values.shape)
  for i in range(len(mask)):
    idx = np.flatnonzero(mask[i] > 0)
    r = COEF * dense[i].copy()
    r[idx[-1]] += kw["rewards"][i]
    a, next_v = 0.0, 0.0
    for t in idx[::-1]:
      a = r[t] + 0.9 * next_v - values[i, t] + 0.9 * 0.8 * a
      want[i, t], next_v = a, values[i, t]
  np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-5)
  assert "reward/prm_mean" in trainer.history[0]


@pytest.mark.parametrize("over, message", [
    ({"rollout.n": 1}, r"needs rollout.n >= 2"),
    ({"reward.implicit_prm.seq_len": 40}, r"reward.implicit_prm.seq_len=40 cannot hold"),
    ({"reward.implicit_prm.beta": 0.0}, r"reward.implicit_prm.beta must be > 0"),
])
def test_config_errors_name_the_key(tmp_path, prm_dirs, over, message):
  with pytest.raises(ValueError, match=message):
    _prm_config(tmp_path, prm_dirs, **over)


def test_a_prm_with_another_tokenizer_than_the_policy_is_refused(tmp_path, prm_dirs):
  cfg = _prm_config(tmp_path, prm_dirs)
  other = dataclasses.replace(cfg, tokenizer=str(tmp_path / "tok"))
  tok = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  tok.add_tokens(["<extra>"])
  tok.save_pretrained(str(tmp_path / "tok"))
  with pytest.raises(ValueError, match="reward.implicit_prm.policy: the tokenizers of .* differ"):
    rl.RLTrainer(other)


def test_rollouts_with_tool_tokens_or_images_are_refused():
  ro = rl.Rollout(prompt_ids=(np.ones(3, np.int32),), tokens=np.ones((1, 4), np.int32), logprobs=np.zeros((1, 4)),
                  lengths=np.asarray([4]), truncated=np.zeros(1, bool), group_ids=np.zeros(1, np.int32),
                  rewards=np.zeros(1, np.float32), task_rewards=np.zeros(1, np.float32), texts=("",),
                  policy_mask=np.asarray([[1, 0, 0, 1]], np.float32))
  with pytest.raises(ValueError, match="reward.implicit_prm: rollouts with environment/tool tokens"):
    rl_prm.rollout_process_rewards(None, ro, delimiter="\n")
