"""``jaxrl.sampling.latent_sample`` against ``jaxrl.latent``'s greedy decode and its training forward."""

import numpy as np
import pytest
from latent_testlib import chains, teacher_forced_logprobs, tiny_model, tokenizer_and_tokens

from jaxrl import latent, sampling

G, N = 6, 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_latent_sample_matches_latent_decode_and_training_forward(temperature):
  tok, ids = tokenizer_and_tokens()
  model = tiny_model(seed=1)
  prompts = [latent.prompt_ids(tok, ch.question, ids, markers=True, kind="latent", n_thoughts=N)[0] for ch in chains()]
  kw = dict(thoughts=N, eot=ids.eot, eos=ids.eos, pad=ids.pad, max_new_tokens=G)
  out = sampling.latent_sample(model, prompts, temperature=temperature, seed=3, **kw)
  ref = latent.latent_generate(model, prompts, **kw)
  # The latent phase is shared: same thoughts whatever the temperature.
  np.testing.assert_allclose(out.thoughts, ref.thoughts, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(out.n_thoughts, ref.n_thoughts)
  if temperature == 0.0:
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
  else:
    assert not np.array_equal(out.tokens, ref.tokens)  # a random model's samples leave the argmax path
    again = sampling.latent_sample(model, prompts, temperature=temperature, seed=3, **kw)
    np.testing.assert_array_equal(again.tokens, out.tokens)
  for r, want in enumerate(teacher_forced_logprobs(model, prompts, out.tokens, out.lengths, ids, [N] * len(prompts))):
    np.testing.assert_allclose(out.logprobs[r, :out.lengths[r]], want, atol=1e-5, rtol=1e-5)
    assert (out.logprobs[r, out.lengths[r]:] == 0).all() and (out.tokens[r, out.lengths[r]:] == ids.pad).all()
