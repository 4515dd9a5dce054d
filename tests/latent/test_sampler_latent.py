"""Latent mode of ``jaxrl.sampling.Sampler`` against the teacher-forced training forward at the same thoughts."""

import numpy as np
import pytest
from flax import nnx
from latent_testlib import chains, teacher_forced_logprobs, tiny_model, tokenizer_and_tokens

from jaxrl import latent, sampling

G = 6
COUNTS = [3, 0, 2]  # thoughts per prompt (one without any: <bot><eot>)


def _sharp_model():
  """The tiny model with sharper attention and logits: at its init (weights ~0.01) attention is nearly
  uniform, so a wrong thought position would move the log-probs by less than the tolerance."""
  model = tiny_model(seed=1)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-1] in ("q_proj", "k_proj", "lm_head"):
      var[...] = var[...] * 20.0
  return model


def _setup():
  tok, ids = tokenizer_and_tokens()
  model = _sharp_model()
  prompts = [list(map(int, latent.prompt_ids(tok, ch.question, ids, markers=True, kind="latent", n_thoughts=k)[0]))
             for ch, k in zip(chains(), COUNTS)]
  sampler = sampling.Sampler(model, max_len=64, eos_token_ids=[ids.eos], pad_token_id=ids.pad, min_bucket=4)
  return model, ids, prompts, sampler


def test_sampler_latent_mode_matches_training_forward():
  model, ids, prompts, sampler = _setup()
  # Each prompt twice, greedy then sampled, two samples each; a different thought count per prompt.
  n, temps = 2, [0.0] * 3 + [1.0] * 3
  out = sampler.generate(prompts * 2, n=n, thoughts=COUNTS * 2, eot=ids.eot, max_new_tokens=G, temperature=temps,
                         seed=5)
  rows = np.arange(6).repeat(n)
  assert (out.prompt_lengths == np.array([len(p) + k + 1 for p, k in zip(prompts, COUNTS)] * 2)[rows]).all()
  want = teacher_forced_logprobs(model, [(prompts * 2)[r] for r in rows], out.tokens, out.lengths, ids,
                                 [(COUNTS * 2)[r] for r in rows], greedy=True)
  for r, (logp, argmax) in enumerate(want):
    length = out.lengths[r]
    assert length >= 1 and (out.logprobs[r, length:] == 0).all() and (out.tokens[r, length:] == ids.pad).all()
    np.testing.assert_allclose(out.logprobs[r, :length], logp, atol=1e-5, rtol=1e-5)
    if temps[rows[r]] == 0.0:  # greedy rows: the training forward's argmax at every step
      np.testing.assert_array_equal(out.tokens[r, :length], argmax)
  # Paused after 2 tokens and resumed (same weights): the uninterrupted tokens; new weights are refused.
  part = sampler.generate(prompts * 2, n=n, thoughts=COUNTS * 2, eot=ids.eot, max_new_tokens=G, temperature=temps,
                          seed=5, max_steps=2, return_state=True)
  with pytest.raises(ValueError, match="latent-mode state cannot take new weights"):
    sampler.resume(part.state, new_model=model)
  again = sampler.resume(part.state)
  np.testing.assert_array_equal(again.tokens, out.tokens)
  np.testing.assert_allclose(again.logprobs, out.logprobs, atol=1e-6)
  sampled = out.tokens[rows >= 3]
  assert not np.array_equal(sampled, out.tokens[rows < 3])  # a random model's samples leave the argmax path
  assert not np.array_equal(sampled[0::n], sampled[1::n])  # samples of one prompt draw apart


def test_sampler_latent_mode_bad_input():
  _, ids, prompts, sampler = _setup()
  with pytest.raises(ValueError, match="needs the <eot> id"):
    sampler.generate(prompts, thoughts=2, max_new_tokens=2)
  with pytest.raises(ValueError, match="thoughts: invalid value -1"):
    sampler.generate(prompts, thoughts=-1, eot=ids.eot, max_new_tokens=2)
  with pytest.raises(ValueError, match="raise max_len"):
    sampler.generate(prompts, thoughts=60, eot=ids.eot, max_new_tokens=2)
