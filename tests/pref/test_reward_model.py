"""Bradley–Terry reward models: the loss against float64 numpy, the trainer's step against an unpacked forward,
packing invariance, resume, export and the batched scorer ``jaxrl rl`` uses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import losses, models, pref

from test_dpo_trainer import TINY
from test_dpo_trainer import _cfg as _dpo_cfg


def _cfg(tmp_path, **over):
  """The DPO tests' tiny config as a reward model: bradley_terry with centring, no reference, 64 train pairs."""
  base = {"data": {"builtin": {"n_train": 64, "n_heldout": 16, "difficulty": 2, "seed": 0}},
          "loss": {"name": "bradley_terry", "center_coef": 0.05}, "reference": "none",
          "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}}
  return _dpo_cfg(tmp_path, **dict(base, **over))


@pytest.fixture(scope="module")
def tokenizer():
  return models.load_tokenizer(data_lib.tiny_tokenizer_dir())


def _records(n, seed=3):
  task = data_lib.ArithmeticConfig.level(2)
  return pref.arithmetic_pairs(n, split="train", seed=seed, task=task)


def _np_bt(rc, rr, m, lam):
  """``-log σ(rc - rr - m) + λ (rc + rr)²`` and its gradients in float64 (hand-derived: ∂/∂rc = -σ(-z) + 2λs,
  ∂/∂rr = σ(-z) + 2λs, z = rc - rr - m, s = rc + rr)."""
  z = rc - rr - m
  s = rc + rr
  loss = np.log1p(np.exp(-z)) + lam * s ** 2
  sig_neg = 1.0 / (1.0 + np.exp(z))
  return loss, -sig_neg + 2 * lam * s, sig_neg + 2 * lam * s


def test_bradley_terry_loss_matches_float64_numpy_with_margin_and_centring():
  rc = np.array([1.5, -0.3, 0.0, 2.0, -4.0])
  rr = np.array([0.5, 0.2, 0.0, 2.5, 3.0])
  m = np.array([0.0, 0.5, 1.0, -0.25, 2.0])
  lam = 0.1
  want, d_rc, d_rr = _np_bt(rc, rr, m, lam)
  # one hand value: z = 1.5 - 0.5 - 0 = 1: log(1 + e^-1) + 0.1 · 2² = 0.31326 + 0.4
  np.testing.assert_allclose(want[0], np.log1p(np.exp(-1.0)) + 0.4, rtol=1e-12)
  fn = lambda a, b: losses.bradley_terry_loss(a, b, margin=jnp.asarray(m, jnp.float32), center_coef=lam)
  got, metrics = fn(jnp.asarray(rc, jnp.float32), jnp.asarray(rr, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
  g_rc, g_rr = jax.grad(lambda a, b: jnp.sum(fn(a, b)[0]), argnums=(0, 1))(jnp.asarray(rc, jnp.float32),
                                                                          jnp.asarray(rr, jnp.float32))
  np.testing.assert_allclose(np.asarray(g_rc), d_rc, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(g_rr), d_rr, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(metrics["accuracy"]), (rc > rr).astype(np.float32))


def _random_head_rm(seed=0, logprob_feature=False):
  """A tiny reward model with a random (non-zero) head (and log-prob scale 0.7), so rewards and trunk gradients
  are not trivial."""
  vm = pref.reward_value_model(models.ModelSource(**TINY).build(), logprob_feature=logprob_feature)
  rng = np.random.default_rng(seed)
  vm.value_head[...] = jnp.asarray(rng.normal(0, 1.0, vm.value_head[...].shape), jnp.float32)
  vm.value_bias[...] = jnp.asarray(0.3, jnp.float32)
  if logprob_feature:
    vm.logprob_scale[...] = jnp.asarray(0.7, jnp.float32)
  return vm


def _unpacked_scores(vm, seqs, pooling="last"):
  """Each sequence alone in a ``[1, L]`` row; its reward is the head at its last position, or (``mean``) the
  float64 mean of the head over the positions whose next token is an answer token; a
  :class:`jaxrl.pref.LogProbValueModel` adds ``α`` times the float64 mean over those positions of the trunk's
  log-softmax (from its own logits) at the next token."""
  out = []
  for s in seqs:
    tok = jnp.asarray(s["tokens"], jnp.int32)[None]
    pos, seg = jnp.arange(tok.shape[1])[None], jnp.ones_like(tok)
    h = np.asarray(vm.trunk(tok, positions=pos, segment_ids=seg, return_hidden=True)[0], np.float64)  # [L, D]
    v = h @ np.asarray(vm.value_head[...], np.float64) + float(vm.value_bias[...])
    before_answer = np.asarray(s["loss_mask"], bool)[1:]  # position t: token t + 1 is an answer token
    if isinstance(vm, pref.LogProbValueModel):  # position t: log π(token t + 1); the last position is never read
      z = np.asarray(vm.trunk(tok, positions=pos, segment_ids=seg)[0], np.float64)[:-1]  # [L-1, V] logits
      zmax = z.max(-1)
      logp = z[np.arange(len(z)), s["tokens"][1:]] - zmax - np.log(np.exp(z - zmax[:, None]).sum(-1))
      v[:-1] += float(vm.logprob_scale[...]) * logp
    out.append(v[-1] if pooling == "last" else v[:-1][before_answer].mean())
  return np.asarray(out, np.float64)


RM_KINDS = [("last", False), ("mean", False), ("mean", True)]
"""(pooling, logprob_feature) of the reward models the tests cover."""


@pytest.mark.parametrize("pooling,logprob_feature", RM_KINDS)
def test_packing_two_ways_gives_the_same_loss_and_gradients_and_the_unpacked_scores(tokenizer, pooling,
                                                                                   logprob_feature):
  """8 pairs (with margins) packed tightly into 4 rows of 256 vs one sequence per row in 16 rows of 96: the
  loss and every gradient agree, and the loss equals float64 numpy on each sequence scored alone (its last
  token, or its mean over the answer, with or without the log-prob feature)."""
  vm = _random_head_rm(logprob_feature=logprob_feature)
  graphdef, params = nnx.split(vm)
  records = _records(8)
  pairs = [pref.encode_pair(tokenizer, dict(r, margin=0.25 * i), f"pairs:{i}") for i, r in enumerate(records)]
  loss_cfg = pref.PrefLoss(name="bradley_terry", center_coef=0.05, pooling=pooling, logprob_feature=logprob_feature)
  loss_fn = pref.rm_loss_fn(graphdef, loss_cfg)
  grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, pref.pref_prepare(b))[0]))
  out = []
  for rows, seq_len, method in ((4, 256, "best_fit"), (16, 96, "none")):
    arrays = pref.pair_batch(pairs, micro_batches=1, rows=rows, seq_len=seq_len, method=method)
    if method == "best_fit":
      assert (arrays["segment_ids"].max(axis=1) >= 2).all()  # really packed (several sequences a row)
    out.append(grad(params, {k: jnp.asarray(v) for k, v in arrays.items()}))
  (loss_a, grads_a), (loss_b, grads_b) = out
  rc = _unpacked_scores(vm, [p.chosen for p in pairs], pooling)
  rr = _unpacked_scores(vm, [p.rejected for p in pairs], pooling)
  want = np.mean(_np_bt(rc, rr, 0.25 * np.arange(8), 0.05)[0])
  np.testing.assert_allclose(float(loss_a), want, rtol=1e-5)
  np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
  assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads_a))  # the trunk learns too
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):  # float32 sums in another order
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_step_loss_equals_numpy_on_unpacked_sequences_and_resume_is_bitwise(tmp_path, tokenizer):
  """A run killed after step 1 and resumed: step 2's logged loss (rewards no longer all 0) equals float64 numpy's
  Bradley–Terry loss with the pairs' margins and centring on step 2's pairs, each sequence scored alone with the
  weights after step 1; the final parameters equal an uninterrupted run's bitwise."""
  path = tmp_path / "pairs.jsonl"
  rng = np.random.default_rng(0)
  records = [dict(r, margin=float(rng.uniform(0, 1))) for r in _records(24)]
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  over = {"data": {"train": [str(path)]}, "steps": 3}
  straight = pref.DPOTrainer(_cfg(tmp_path / "a", **over))
  straight.run()
  cfg = _cfg(tmp_path / "b", checkpoint={"every": 1, "keep": 2}, **over)
  first = pref.DPOTrainer(cfg)
  assert first.run(until=1)["stopped_at"] == 1
  vm = first.current_model()
  stream = pref.PairStream(len(records), seed=0)
  stream.take(cfg.pairs)
  step2 = [first.train_pairs[i] for i in stream.take(cfg.pairs)]
  rc = _unpacked_scores(vm, [p.chosen for p in step2])
  rr = _unpacked_scores(vm, [p.rejected for p in step2])
  assert np.abs(rc).max() > 1e-4  # the head moved
  want = np.mean(_np_bt(rc, rr, np.asarray([p.margin for p in step2]), 0.05)[0])
  resumed_trainer = pref.DPOTrainer(cfg)
  resumed = resumed_trainer.run()
  assert resumed["start_step"] == 1
  np.testing.assert_allclose(resumed["history"][0]["loss"], want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed_trainer.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("pooling,logprob_feature", RM_KINDS)
def test_export_and_the_batched_scorer_equal_a_direct_forward(tmp_path, tokenizer, pooling, logprob_feature):
  """The exported trunk + head, loaded by :class:`jaxrl.pref.RewardModel`, scores (prompt, completion) batches
  (several packed batches of 8 rows) as the trained model does on each sequence alone; the export keeps the
  pooling and the log-prob feature (its trained scale and the trunk's unembedding)."""
  trainer = pref.DPOTrainer(_cfg(tmp_path, steps=3, export_hf=True,
                                 loss={"name": "bradley_terry", "center_coef": 0.05, "pooling": pooling,
                                       "logprob_feature": logprob_feature}))
  out = trainer.run()
  head = out["reward_head"]
  assert head.endswith(pref.REWARD_HEAD_FILE)
  vm = trainer.current_model()
  assert isinstance(vm, pref.LogProbValueModel) == logprob_feature
  loaded = pref.load_reward_model(out["hf_dir"])
  assert type(loaded) is type(vm)
  if logprob_feature:
    assert float(vm.logprob_scale[...]) != 1.0  # trained
    assert float(loaded.logprob_scale[...]) == float(vm.logprob_scale[...])
    np.testing.assert_array_equal(np.asarray(loaded.trunk.unembed_matrix()), np.asarray(vm.trunk.unembed_matrix()))
  records = _records(40, seed=9)
  prompts = [r["prompt"] for r in records] + [[{"role": "user", "content": r["prompt"]}] for r in records[:4]]
  completions = [r["chosen"] if i % 2 else r["rejected"] for i, r in enumerate(records)] + [
      r["chosen"] for r in records[:4]]
  rm = pref.RewardModel.load(out["hf_dir"], rows=8, seq_len=128)
  assert rm.pooling == pref.reward_pooling(out["hf_dir"]) == pooling
  got = rm.score(prompts, completions)
  seqs = [rm.encode(p, c) for p, c in zip(prompts, completions)]
  assert len(data_lib.assign_rows([len(s["tokens"]) for s in seqs], 128, method="best_fit")) > 8  # > 1 batch
  want = _unpacked_scores(vm, seqs, pooling)
  assert np.std(want) > 1e-4
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # A one-user-turn message list encodes as the string does, so it scores the same (up to the summation order
  # of the packed row it lands in: the two copies sit in different rows).
  for i in (1, 3):
    np.testing.assert_array_equal(seqs[len(records) + i]["tokens"], seqs[i]["tokens"])
  np.testing.assert_allclose(got[-4:][[1, 3]], got[[1, 3]], rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match=r"sample 0: prompt \+ completion is \d+ tokens, longer than "
                                       r"reward.model.seq_len=8"):
    pref.RewardModel.load(out["hf_dir"], rows=8, seq_len=8).score(prompts[:1], completions[:1])


def test_config_errors_name_the_key(tmp_path):
  with pytest.raises(ValueError, match="set reference: none"):
    _cfg(tmp_path, reference="model")
  with pytest.raises(ValueError, match="loss.center_coef applies to loss.name: bradley_terry only"):
    _cfg(tmp_path, loss={"name": "sigmoid", "center_coef": 0.1}, reference="model")
  with pytest.raises(ValueError, match="loss.pooling applies to loss.name: bradley_terry only"):
    _cfg(tmp_path, loss={"name": "sigmoid", "pooling": "mean"}, reference="model")
  with pytest.raises(ValueError, match=r"loss.pooling must be one of \['last', 'mean'\], got 'max'"):
    _cfg(tmp_path, loss={"name": "bradley_terry", "pooling": "max"})
  with pytest.raises(ValueError, match="loss.logprob_feature applies to loss.name: bradley_terry with "
                                       "loss.pooling: mean"):
    _cfg(tmp_path, loss={"name": "bradley_terry", "logprob_feature": True})
  with pytest.raises(ValueError, match="loss.logprob_feature applies"):
    _cfg(tmp_path, loss={"name": "sigmoid", "logprob_feature": True}, reference="model")
  with pytest.raises(ValueError, match="LoRA is not supported for reward models"):
    _cfg(tmp_path, lora={"rank": 4, "alpha": 8.0})


def test_reward_model_fits_its_train_pairs(tmp_path):
  """The same 8 train pairs every step: the reward model must rank all of them (a learning check that fits in
  the test budget; held-out accuracy over 3 seeds is in docs/benchmarks.md)."""
  cfg = _cfg(tmp_path, steps=15, data={"builtin": {"n_train": 8, "n_heldout": 8, "difficulty": 2, "seed": 0}},
             optim={"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}, loss={"name": "bradley_terry"})
  out = pref.DPOTrainer(cfg).run()
  assert np.mean(out["losses"][-3:]) < 0.2, out["losses"]
  assert np.mean([r["accuracy"] for r in out["history"][-3:]]) == 1.0, out["history"]


def test_a_malformed_logprob_scale_is_refused_before_the_trunk_is_read(tmp_path):
  """A head file whose ``score.logprob_scale`` is not ``[1]`` is an error naming the file, raised before the
  trunk's weights are read (here there are none)."""
  from safetensors.numpy import save_file

  save_file({"score.weight": np.zeros((1, 32), np.float32), "score.bias": np.zeros(1, np.float32),
             "score.logprob_scale": np.ones(2, np.float32)}, str(tmp_path / pref.REWARD_HEAD_FILE))
  with pytest.raises(ValueError, match=r"reward_head.safetensors: want score.logprob_scale \[1\]"):
    pref.load_reward_model(tmp_path)
