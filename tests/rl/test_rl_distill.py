"""On-policy distillation in the RL trainer (``distill:``): the reverse-KL advantage against direct forwards of
both models, a teacher equal to the student (exactly 0 advantage, parameters unchanged), GKD's JSD metric against
a float64 numpy JSD of both models' full logits (on the student's samples and on GKD's fixed completions, λ < 1),
the seeded on/off-policy draws, tokenizer / vocabulary refusals, and short runs whose reverse KL
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
from jaxrl.rl._distill import FixedCompletions, MixedRollout
from jaxrl.rl._source import RolloutBatch

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


def _numpy_jsd(student, teacher, ro, *, beta, temperature):
  """The token-mean generalised JSD of ``ro``'s response tokens between two models' full float64 logits, each
  sequence run on its own (no packing)."""
  seqs = [np.concatenate([ro.prompt_ids[i], ro.tokens[i, :int(ro.lengths[i])]])[:-1] for i in range(ro.num_samples)]
  width = max(len(x) for x in seqs)
  tokens = np.stack([np.pad(x, (0, width - len(x))) for x in seqs])  # [N, W], one sequence a row
  seg = (np.arange(width)[None] < np.asarray([len(x) for x in seqs])[:, None]).astype(np.int32)
  pos = np.broadcast_to(np.arange(width)[None], tokens.shape)
  s_all = _np_logsoftmax(_direct_logits(student, tokens, pos, seg), temperature)  # [N, W, V]
  t_all = _np_logsoftmax(_direct_logits(teacher, tokens, pos, seg), temperature)
  per_token = []
  for i, x in enumerate(seqs):  # response token k is predicted at position len(prompt) - 1 + k
    n = int(ro.lengths[i])
    s, t = s_all[i, len(x) - n:len(x)], t_all[i, len(x) - n:len(x)]
    m = np.logaddexp(s + np.log(1 - beta), t + np.log(beta))
    per_token.append(beta * np.sum(np.exp(t) * (t - m), -1) + (1 - beta) * np.sum(np.exp(s) * (s - m), -1))
  return np.concatenate(per_token).mean()  # token_mean over every response token of the step


def test_gkd_jsd_metric_equals_numpy_jsd_of_both_models(tmp_path, teacher_dir):
  cfg = _cfg(tmp_path, {"hf_dir": teacher_dir}, steps=1, distill={"mode": "gkd", "beta": 0.3, "temperature": 0.9},
             **{"algorithm.mini_batches": 1})
  trainer = RLTrainer(cfg)
  try:
    student = nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.state.params))  # rollout parameters
    trainer.run()
    want = _numpy_jsd(student, models.load_pretrained(teacher_dir), trainer.last_rollout, beta=0.3, temperature=0.9)
    np.testing.assert_allclose(trainer.update_history[0]["distill/jsd"], want, rtol=1e-4)
    assert np.isfinite(trainer.history[-1]["loss"])
    assert "distill/on_policy" not in trainer.history[-1]  # λ = 1: no mixture
  finally:
    trainer.close()


def _fixed_file(tmp_path, cfg, name="fixed.jsonl"):
  """The config's built-in training questions with short answers as ``messages`` records (fixed completions)."""
  recs = [{"messages": [r["messages"][0], {"role": "assistant", "content": f"Answer: {r['answer']}"}]}
          for r in cfg.data.builtin.records("train")]
  return data.write_jsonl(recs, tmp_path / name), recs


def _template_ids(tok, messages):
  """The chat template's token ids of a conversation through the assistant's end of turn, and the prompt's."""
  full = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
  head = tok(tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
             add_special_tokens=False)["input_ids"]
  end = len(full) - full[::-1].index(tok.eos_token_id)
  return full[:end], head


def test_gkd_off_policy_steps_train_on_the_fixed_completions(tmp_path, teacher_dir):
  """distill.lmbda = 0 (supervised KD on fixed completions): the step's rows are the records' chat-template tokens
  in the seeded order, through the end of turn, and the JSD metric equals numpy's on exactly those sequences."""
  path, recs = _fixed_file(tmp_path, _cfg(tmp_path, {"hf_dir": teacher_dir}))
  cfg = _cfg(tmp_path, {"hf_dir": teacher_dir}, steps=1, distill={
      "mode": "gkd", "beta": 0.3, "temperature": 0.9, "lmbda": 0.0, "data": [str(path)]},
      **{"algorithm.mini_batches": 1})
  trainer = RLTrainer(cfg)
  try:
    student = nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.state.params))
    trainer.run()
    ro = trainer.last_rollout
    assert ro.num_samples == 16  # prompts_per_step × n, as an on-policy step
    order = np.random.default_rng([cfg.data.shuffle_seed, 0]).permutation(len(recs))
    for i in range(ro.num_samples):
      full, head = _template_ids(trainer.tokenizer, recs[order[i]]["messages"])
      got = np.concatenate([ro.prompt_ids[i], ro.tokens[i, :int(ro.lengths[i])]]).tolist()
      assert got == full and ro.prompt_ids[i].tolist() == head, i
    want = _numpy_jsd(student, models.load_pretrained(teacher_dir), ro, beta=0.3, temperature=0.9)
    np.testing.assert_allclose(trainer.update_history[0]["distill/jsd"], want, rtol=1e-4)
    h = trainer.history[-1]
    assert h["distill/on_policy"] == 0.0 and "accuracy" not in h and "reward/mean" not in h
    assert h["response/length_mean"] == ro.lengths.mean()
  finally:
    trainer.close()


class _Inner:
  """A stand-in on-policy source that records the steps it was asked for."""

  def __init__(self):
    self.steps = []

  def rollout(self, step, prompts, stream):
    self.steps.append(step)
    return RolloutBatch(rollout=None, drawn=None, metrics={"inner": 1.0})


def test_mixed_rollout_draws_are_seeded_and_each_off_policy_step_takes_the_next_rows(tmp_path):
  cfg = make_config(tmp_path)
  path, recs = _fixed_file(tmp_path, cfg)
  fixed = FixedCompletions([path], models.load_tokenizer(data.tiny_tokenizer_dir()), max_prompt_tokens=32,
                           max_new=16, seed=3)
  mix = lambda **kw: MixedRollout(_Inner(), fixed, rollout=cfg.rollout, lmbda=0.5, seed=11, steps=40, **kw)
  a, b = mix(), mix()
  rows = []
  for step in range(1, 41):
    got = a.rollout(step, None, None)
    assert (got.metrics["distill/on_policy"] == 1.0) == bool(a.flips[step])
    assert b.rollout(step, None, None).metrics["distill/on_policy"] == got.metrics["distill/on_policy"]  # resume
    if got.rollout is not None:
      assert got.rollout.num_samples == 16
      halves = [mix(procs=2, pid=p).rollout(step, None, None).rollout for p in (0, 1)]
      assert [x.tolist() for h in halves for x in h.prompt_ids] == [x.tolist() for x in got.rollout.prompt_ids]
      rows += [x.tolist() + t[:n].tolist() for x, t, n in zip(got.rollout.prompt_ids, got.rollout.tokens,
                                                             got.rollout.lengths)]
  off = 40 - int(a.flips[1:].sum())
  assert 10 <= off <= 30 and a.inner.steps == [s for s in range(1, 41) if a.flips[s]]
  want = [fixed.index(p) for p in range(16 * off)]  # consecutive stream positions, each epoch a permutation
  assert sorted(want[:len(recs)]) == list(range(len(recs)))
  tok = models.load_tokenizer(data.tiny_tokenizer_dir())
  assert rows == [_template_ids(tok, recs[k]["messages"])[0] for k in want]


def test_gkd_fixed_completion_refusals(tmp_path, teacher_dir):
  cfg = _cfg(tmp_path, {"hf_dir": teacher_dir})
  path, recs = _fixed_file(tmp_path, cfg)
  tok = models.load_tokenizer(data.tiny_tokenizer_dir())
  two = dict(recs[1], messages=recs[1]["messages"] + [{"role": "user", "content": "and?"},
                                                      {"role": "assistant", "content": "1"}])
  bad = data.write_jsonl([recs[0], two], tmp_path / "two_turns.jsonl")
  with pytest.raises(data.DataError, match=r"two_turns.jsonl:2: distill.data needs one assistant answer"):
    FixedCompletions([bad], tok, max_prompt_tokens=32, max_new=16, seed=0)
  with pytest.raises(data.DataError, match=r"fixed.jsonl:1: completion of \d+ tokens is over the 4 new tokens"):
    FixedCompletions([path], tok, max_prompt_tokens=32, max_new=4, seed=0)
  with pytest.raises(data.DataError, match=r"fixed.jsonl:1: prompt of \d+ tokens is over data.max_prompt_tokens=3"):
    FixedCompletions([path], tok, max_prompt_tokens=3, max_new=16, seed=0)


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
  with pytest.raises(ValueError, match="distill.lmbda must be in"):
    load("distill.mode=gkd", "distill.lmbda=1.5")
  with pytest.raises(ValueError, match="only mode gkd can"):
    load("distill.lmbda=0.5", "distill.data=[x.jsonl]")
  with pytest.raises(ValueError, match="needs distill.data"):
    load("distill.mode=gkd", "distill.lmbda=0.5")
  with pytest.raises(ValueError, match="distill.data is read only by off-policy steps"):
    load("distill.mode=gkd", "distill.data=[x.jsonl]")
  with pytest.raises(ValueError, match="set reward_coef: 0"):
    load("distill.mode=gkd", "distill.lmbda=0.5", "distill.data=[x.jsonl]", "distill.reward_coef=0.5")
  with pytest.raises(ValueError, match="old_logprobs: recompute"):
    load("distill.mode=gkd", "distill.lmbda=0.5", "distill.data=[x.jsonl]", "algorithm.old_logprobs=sampler")
  assert load("distill.mode=gkd", "distill.lmbda=0.5", "distill.data=[x.jsonl]").distill.lmbda == 0.5
