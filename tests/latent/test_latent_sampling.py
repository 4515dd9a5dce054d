"""``jaxrl.sampling.latent_sample`` against ``jaxrl.latent``'s greedy decode and its training forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from latent_testlib import chains, tiny_model, tokenizer_and_tokens

from jaxrl import latent, sampling

G, N = 6, 3


def teacher_forced_logprobs(model, prompts, out, ids):
  """Log-probs of the sampled tokens under the training forward (``latent_hidden``, ``N`` thoughts)."""
  examples = []
  for p, gen, length in zip(prompts, out.tokens, out.lengths):
    suffix = np.concatenate([[ids.eot], gen[:length]]).astype(np.int32)
    examples.append(latent.StageExample(prompt=p, n_thoughts=N, kind="latent", suffix=suffix,
                                        suffix_loss=np.ones(len(suffix), bool), answer=""))
  layout = latent.Layout.fit(examples)
  rows = latent.make_rows(examples, layout, ids)
  h = latent.latent_hidden(model, *(jnp.asarray(rows[k]) for k in ("tokens", "positions", "segment_ids",
                                                                      "thought_mask")),
                           prefix=layout.prefix, thoughts=layout.thoughts)
  logp = np.asarray(jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, model.unembed_matrix()), axis=-1))
  first = layout.prefix + layout.thoughts  # the <eot> column predicts the first language token
  return [logp[r, first + np.arange(n), gen[:n]] for r, (gen, n) in enumerate(zip(out.tokens, out.lengths))]


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
  for r, want in enumerate(teacher_forced_logprobs(model, prompts, out, ids)):
    np.testing.assert_allclose(out.logprobs[r, :out.lengths[r]], want, atol=1e-5, rtol=1e-5)
    assert (out.logprobs[r, out.lengths[r]:] == 0).all() and (out.tokens[r, out.lengths[r]:] == ids.pad).all()
