"""On-policy distillation in the RL trainer (``distill:``): the reverse-KL advantage against direct forwards of
both models, a teacher equal to the student (exactly 0 advantage, parameters unchanged), GKD's JSD metric against
a float64 numpy JSD of both models' full logits, tokenizer / vocabulary refusals, and short runs whose reverse KL
to the teacher falls."""

from __future__ import annotations

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import data, models
from jaxrl.rl import RLConfig, RLTrainer
from jaxrl.rl import check_shared_vocab

from rl_testlib import TINY, make_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TEACHER = {"preset": "tiny", "seed": 7, "overrides": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 192,
                                                       "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}


def _save(model, tmp_path_factory, name):
  out = tmp_path_factory.mktemp(name)
  models.save_pretrained(model, out, tokenizer=models.load_tokenizer(data.tiny_tokenizer_dir()))
  return str(out)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A random teacher wider than the student (the quickstart's size): context-dependent log-probs, so a
  misaligned position or a wrong model would show."""
  return _save(models.ModelSource(preset="tiny", seed=7, overrides=TEACHER["overrides"]).build(), tmp_path_factory,
               "teacher")


@pytest.fixture(scope="module")
def peaked_teacher_dir(tmp_path_factory):
  """The same wide teacher with every token embedded alike, so its next-token distribution is one fixed, peaked
  distribution (logits of std 3) in every context: a target a random student can approach in a few steps (random
  tiny models are near-uniform, and a random context-dependent teacher takes far longer to imitate)."""
  model = models.ModelSource(preset="tiny", seed=7, overrides=TEACHER["overrides"]).build()
  model.embed[...] = jnp.broadcast_to(model.embed[...][:1], model.embed[...].shape)
  z = np.asarray(model(jnp.zeros((1, 4), jnp.int32), positions=jnp.arange(4)[None],
                       segment_ids=jnp.ones((1, 4), jnp.int32)))  # [1, 4, V]
  assert np.abs(z - z[:, :1]).max() < 1e-5  # the same distribution at every position
  model.lm_head[...] = model.lm_head[...] * (3.0 / z.std())
  return _save(model, tmp_path_factory, "peaked_teacher")


def _cfg(tmp_path, teacher, **over):
  over = {"distill": {"teacher": teacher, **over.pop("distill", {})}, "reward.fn": "rl_testlib:digit_fraction",
          **over}
  return make_config(tmp_path, **over)


def _direct_logits(model, tokens, positions, segment_ids):  # [B, T, V] float64
  return np.asarray(model(tokens, positions=positions, segment_ids=segment_ids), np.float64)


def _np_logsoftmax(z, temperature):
  z = z / temperature
  return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)


def _batches(trainer, step=1):
  """The first mini-batch of a fresh rollout, packed and on device, advantages as the trainer's pack made them."""
  rollout, _ = trainer.collect(step)
  packed, _ = trainer.pack(rollout, step)
  return packed[:1], [trainer._device(packed[0].interleaved())]


def test_reverse_kl_advantage_equals_direct_forwards(tmp_path, teacher_dir):
  trainer = RLTrainer(_cfg(tmp_path, {"hf_dir": teacher_dir}, distill={"coef": 0.5},
                           **{"rollout.temperature": 0.8}))
  try:
    packed, batches = _batches(trainer)
    metrics = trainer._distill(batches, packed)
    got = np.asarray(batches[0]["advantages"])
    b = {k: np.asarray(v) for k, v in batches[0].items()}
    student, teacher = trainer.current_model(), models.load_pretrained(teacher_dir)
    args = (b["tokens"], b["positions"], b["segment_ids"])
    lp = lambda m: np.take_along_axis(_np_logsoftmax(_direct_logits(m, *args), 0.8), b["targets"][..., None], -1)[..., 0]
    s, t = lp(student), lp(teacher)
    mask = b["loss_mask"] > 0
    assert mask.sum() > 20
    np.testing.assert_allclose(got[mask], (-0.5 * (s - t))[mask], rtol=1e-4, atol=2e-5)
    assert np.all(got[~mask] == 0.0)
    np.testing.assert_allclose(metrics["distill/reverse_kl"], (s - t)[mask].mean(), rtol=1e-4)
    assert abs(metrics["distill/reverse_kl"]) > 1e-3  # two different models
  finally:
    trainer.close()


def test_teacher_equal_to_student_gives_zero_advantage_and_no_update(tmp_path):
  trainer = RLTrainer(_cfg(tmp_path, TINY, steps=1))  # the same source: the student's own initial weights
  try:
    before = jax.tree.map(np.asarray, trainer.state.params)
    packed, batches = _batches(trainer)
    metrics = trainer._distill(batches, packed)
    assert np.all(np.asarray(batches[0]["advantages"]) == 0.0)
    assert metrics["distill/reverse_kl"] == 0.0
    trainer.run()
    after = jax.tree.map(np.asarray, trainer.state.params)
    assert trainer.history[-1]["distill/reverse_kl"] == 0.0
    assert trainer.history[-1]["advantage/abs_mean"] == 0.0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
      assert np.array_equal(x, y), f"{jax.tree_util.keystr(path)} changed under a zero advantage"
  finally:
    trainer.close()


def test_gkd_jsd_metric_equals_numpy_jsd_of_both_models(tmp_path, teacher_dir):
  cfg = _cfg(tmp_path, {"hf_dir": teacher_dir}, steps=1, distill={"mode": "gkd", "beta": 0.3, "temperature": 0.9},
             **{"algorithm.mini_batches": 1})
  trainer = RLTrainer(cfg)
  try:
    student = nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.state.params))  # rollout parameters
    trainer.run()
    ro = trainer.last_rollout
    teacher = models.load_pretrained(teacher_dir)
    seqs = [np.concatenate([ro.prompt_ids[i], ro.tokens[i, :int(ro.lengths[i])]])[:-1] for i in range(ro.num_samples)]
    width = max(len(x) for x in seqs)
    tokens = np.stack([np.pad(x, (0, width - len(x))) for x in seqs])  # [N, W], one sequence a row
    seg = (np.arange(width)[None] < np.asarray([len(x) for x in seqs])[:, None]).astype(np.int32)
    pos = np.broadcast_to(np.arange(width)[None], tokens.shape)
    s_all = _np_logsoftmax(_direct_logits(student, tokens, pos, seg), 0.9)  # [N, W, V]
    t_all = _np_logsoftmax(_direct_logits(teacher, tokens, pos, seg), 0.9)
    per_token = []
    for i, x in enumerate(seqs):  # response token k is predicted at position len(prompt) - 1 + k
      n = int(ro.lengths[i])
      s, t = s_all[i, len(x) - n:len(x)], t_all[i, len(x) - n:len(x)]
      m = np.logaddexp(s + np.log(0.7), t + np.log(0.3))
      per_token.append(0.3 * np.sum(np.exp(t) * (t - m), -1) + 0.7 * np.sum(np.exp(s) * (s - m), -1))
    want = np.concatenate(per_token).mean()  # token_mean over every response token of the step
    got = trainer.update_history[0]["distill/jsd"]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert np.isfinite(trainer.history[-1]["loss"])
  finally:
    trainer.close()


def test_tokenizer_mismatch_is_refused(tmp_path, teacher_dir):
  other = tmp_path / "other_tok"
  shutil.copytree(data.tiny_tokenizer_dir(), other)
  tok = models.load_tokenizer(str(other))
  tok.add_tokens(["<extra_teacher_token>"])
  tok.save_pretrained(str(other))
  with pytest.raises(ValueError, match=r"tokenizer differs.*student preset=tiny.*teacher hf_dir=.*other_tok"):
    RLTrainer(_cfg(tmp_path, {"hf_dir": teacher_dir}, distill={"tokenizer": str(other)}))
  base = models.load_tokenizer(data.tiny_tokenizer_dir())
  with pytest.raises(ValueError, match="vocab sizes differ .student 128, teacher 256"):
    check_shared_vocab(base, base, student_vocab=128, teacher_vocab=256, student="s", teacher="t",
                       same_vocab_size=True)
  check_shared_vocab(base, base, student_vocab=128, teacher_vocab=256, student="s", teacher="t",
                     same_vocab_size=False)  # reverse_kl reads sampled-token log-probs only: padded rows are fine


@pytest.mark.parametrize("mode", ["reverse_kl", "gkd"])
def test_tiny_config_brings_the_student_closer_to_the_teacher(tmp_path, peaked_teacher_dir, mode):
  """configs/distill_tiny.yaml end to end (its quickstart-size teacher given weights), 6 steps."""
  cfg = config_lib.load(RLConfig, CONFIGS / "distill_tiny.yaml", [
      "distill.teacher.preset=null", f"distill.teacher.hf_dir={peaked_teacher_dir}", f"distill.mode={mode}",
      "steps=6", "eval.every=0", f"out_dir={tmp_path / 'run'}", "tensorboard=false"])
  trainer = RLTrainer(cfg)
  try:
    trainer.run()
  finally:
    trainer.close()
  kl = np.asarray([h["distill/reverse_kl"] for h in trainer.history])
  assert np.all(np.isfinite([h["loss"] for h in trainer.history]))
  assert kl[-2:].mean() < kl.mean() - 0.25 * (kl.max() - kl.min()), kl  # a fall with margin, not noise
  assert kl[-2:].mean() < 0.85 * kl[:2].mean(), kl


def test_distill_config_refusals():
  load = lambda *o: config_lib.load(RLConfig, CONFIGS / "distill_tiny.yaml", list(o))  # noqa: E731
  assert load().distill.teacher.config().hidden_size > load().model.config().hidden_size  # a larger teacher
  with pytest.raises(ValueError, match="dynamic_sampling"):
    load("rollout.dynamic_sampling=true")
  load("rollout.dynamic_sampling=true", "distill.reward_coef=0.5")  # with a task reward it is meaningful
  with pytest.raises(ValueError, match="critic"):
    load("algorithm.advantage=gae", "critic={}")
  with pytest.raises(ValueError, match="distill.beta"):
    load("distill.beta=1.5")
