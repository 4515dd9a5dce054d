"""Implicit process rewards of a DPO policy and its reference (:class:`jaxrl.pref.ImplicitPRM`): token rewards against
float64 numpy over separate unpacked forwards, packing invariance, token → step mapping and step sums by hand,
best-of-N by the minimum step reward, and the refusals."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import data as data_lib
from jaxrl import models, pref

from test_dpo_trainer import TINY

BETA = 0.3


def _perturbed(model, seed: int, scale: float):
  """``model`` with every floating parameter moved by N(0, scale²) noise (a stand-in for a DPO-trained policy)."""
  graphdef, state = nnx.split(model)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
           for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


@pytest.fixture(scope="module")
def prm_dirs(tmp_path_factory):
  """``(policy dir, reference dir, policy, reference, tokenizer)``: a tiny random reference and a perturbed copy."""
  tok = models.load_tokenizer(data_lib.tiny_tokenizer_dir())
  reference = models.ModelSource(**TINY).build()
  policy = _perturbed(reference, seed=1, scale=0.05)
  root = tmp_path_factory.mktemp("prm")
  models.save_pretrained(policy, root / "policy", tokenizer=tok)
  models.save_pretrained(reference, root / "reference", tokenizer=tok)
  return root / "policy", root / "reference", policy, reference, tok


@pytest.fixture(scope="module")
def prm(prm_dirs):
  return pref.ImplicitPRM.load(prm_dirs[0], prm_dirs[1], beta=BETA, rows=8, seq_len=96)


def _np_logps(model, ids):
  """float64 log-softmax of one unpacked ``[1, L]`` forward; ``[L - 1]`` log-probs of tokens 1..L-1."""
  tok = jnp.asarray(ids, jnp.int32)[None]
  logits = np.asarray(model(tok, positions=jnp.arange(tok.shape[1])[None], segment_ids=jnp.ones_like(tok)),
                      np.float64)[0]  # [L, V]
  z = logits - logits.max(-1, keepdims=True)
  lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return lsm[np.arange(len(ids) - 1), np.asarray(ids[1:])]


PROMPTS = ["What is 3+4?", "Add 12 and 5.", "Compute 6*7, step by step.", "2+2?", "Say 9."]
COMPLETIONS = ["3+4=7\nAnswer: 7", "12+5=17\n\nso 17\nAnswer: 17", "6*7=42\nAnswer: 42\n", "4", "9\n9\n9\n9"]


def test_token_rewards_equal_float64_numpy_of_separate_forwards(prm, prm_dirs):
  """q_t = β (log π − log π_ref) at every completion token (the chat template's assistant tokens, end of turn
  included), each model run alone on each unpacked sequence."""
  _, _, policy, reference, tok = prm_dirs
  got = prm.token_rewards(PROMPTS, COMPLETIONS)
  for p, c, q in zip(PROMPTS, COMPLETIONS, got):
    seq = data_lib.encode_chat(tok, pref.answer_messages(p, c))
    ids, trained = seq["tokens"], np.flatnonzero(seq["loss_mask"])
    assert tok.decode(ids[trained]).startswith(c) and len(q) == len(trained)
    want = BETA * (_np_logps(policy, ids) - _np_logps(reference, ids))[trained - 1]
    np.testing.assert_allclose(q, want, rtol=1e-4, atol=1e-5)
  assert np.abs(np.concatenate(got)).max() > 1e-2  # the perturbation shows


def test_packing_two_ways_gives_the_same_rewards(prm_dirs):
  """Best-fit packing into 8 rows of 256 (several sequences a row) vs 8 rows of 72 (one or two a row, two
  batches): the same token rewards."""
  policy, reference, tok = prm_dirs[2], prm_dirs[3], prm_dirs[4]
  prompts, completions = PROMPTS * 3, COMPLETIONS * 3
  tight = pref.ImplicitPRM(policy, reference, tok, beta=BETA, rows=8, seq_len=256)
  loose = pref.ImplicitPRM(policy, reference, tok, beta=BETA, rows=8, seq_len=72)
  lengths = [len(p) + len(c) for p, c in zip(*tight._encode_all(prompts, completions))]
  assert len(data_lib.assign_rows(lengths, 256, method="best_fit")) < len(lengths) // 2  # really packed
  assert len(data_lib.assign_rows(lengths, 72, method="best_fit")) > 8  # several batches
  for a, b in zip(tight.token_rewards(prompts, completions), loose.token_rewards(prompts, completions)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_token_ids_are_scored_as_given(prm, prm_dirs):
  """score_ids on raw ids (no template): β (log π − log π_ref) of exactly those completion ids."""
  policy, reference = prm_dirs[2], prm_dirs[3]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 100, size=n) for n in (1, 4, 9)]
  completions = [rng.integers(3, 100, size=n) for n in (5, 0, 30)]
  got = prm.score_ids(prompts, completions)
  for p, c, q in zip(prompts, completions, got):
    ids = np.concatenate([p, c])
    want = BETA * (_np_logps(policy, ids) - _np_logps(reference, ids))[len(p) - 1:]
    np.testing.assert_allclose(q, want, rtol=1e-4, atol=1e-5)


def test_steps_by_hand_on_a_known_string(prm, prm_dirs):
  """The tiny tokenizer has one token per character: "ab\\ncd\\n\\nef" splits after each newline with "\\n",
  only after the blank line with "\\n\\n" (its last newline closes the step), and into tokens with None."""
  tok = prm_dirs[4]
  ids = tok("ab\ncd\n\nef", add_special_tokens=False)["input_ids"]
  assert len(ids) == 9
  np.testing.assert_array_equal(pref.step_ids(tok, ids, "\n"), [1, 1, 1, 2, 2, 2, 3, 4, 4])
  np.testing.assert_array_equal(pref.step_ids(tok, ids, "\n\n"), [1, 1, 1, 1, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(pref.step_ids(tok, ids, None), np.arange(1, 10))
  np.testing.assert_array_equal(pref.step_ids(tok, ids[:6], "\n"), [1, 1, 1, 2, 2, 2])  # ends with "\n": no empty step
  q = np.arange(1.0, 10.0)
  np.testing.assert_allclose(pref.step_rewards([q], [pref.step_ids(tok, ids, "\n")])[0], [6, 15, 7, 17])
  np.testing.assert_allclose(pref.step_end_rewards(q, pref.step_ids(tok, ids, "\n")), [0, 0, 6, 0, 0, 15, 7, 0, 17])
  # Through the model: "3+4=7\nAnswer: 7" + end of turn has steps "3+4=7\n" and "Answer: 7<|im_end|>".
  q = prm.token_rewards(PROMPTS[:1], COMPLETIONS[:1])[0]
  assert len(q) == 16
  np.testing.assert_allclose(prm.step_rewards(PROMPTS[:1], COMPLETIONS[:1])[0], [q[:6].sum(), q[6:].sum()],
                             rtol=1e-5, atol=1e-6)


def test_best_of_n_picks_the_largest_minimum_step_reward(prm):
  """Per prompt, the completion whose smallest step reward is largest (hand: min over the hand-split steps)."""
  groups = [COMPLETIONS[:4], COMPLETIONS[1:], ["1\n2", "12", "1\n\n2\n"]]
  prompts = PROMPTS[:3]
  got = prm.best_of_n(prompts, groups)
  want, by_total = [], []
  for p, g in zip(prompts, groups):
    mins, totals = [], []
    for c in g:
      q = prm.token_rewards([p], [c])[0]
      cuts = [i + 1 for i, ch in enumerate(c) if ch == "\n"]  # one token per character; end of turn: last step
      bounds = [0] + cuts + ([len(q)] if not cuts or cuts[-1] < len(q) else [])
      mins.append(min(q[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])))
      totals.append(q.sum())
    want.append(int(np.argmax(mins)))
    by_total.append(int(np.argmax(totals)))
  np.testing.assert_array_equal(got, want)
  assert any(w != 0 for w in want)
  assert want != by_total  # the minimum step reward, not the sequence's total, decides


def test_refusals_name_the_key(prm, prm_dirs, tmp_path):
  with pytest.raises(ValueError, match=r"implicit_prm.seq_len=96"):
    prm.token_rewards(["x"], ["y" * 100])
  # A tokenizer with two ids swapped is a different tokenizer.
  other = tmp_path / "other"
  shutil.copytree(prm_dirs[1], other)
  spec = json.loads((other / "tokenizer.json").read_text())
  vocab = spec["model"]["vocab"]
  a, b = list(vocab)[5:7]
  vocab[a], vocab[b] = vocab[b], vocab[a]
  (other / "tokenizer.json").write_text(json.dumps(spec))
  with pytest.raises(ValueError, match="implicit_prm: the tokenizers of the policy .* and the reference .* differ"):
    pref.ImplicitPRM.load(prm_dirs[0], other, beta=BETA)
  with pytest.raises(ValueError, match="rows=3 must be a multiple"):
    pref.ImplicitPRM(prm_dirs[2], prm_dirs[3], prm_dirs[4], beta=BETA, rows=3)
