"""Latent decoding against the training forward at the same thoughts (teacher forcing)."""

import jax.numpy as jnp
import numpy as np
import pytest
from latent_testlib import chains, tiny_model, tokenizer_and_tokens

from jaxrl import latent

G = 6


@pytest.mark.parametrize("markers,kind,n", [(True, "latent", 3), (False, "none", 0)])
def test_decode_matches_teacher_forced_training_forward(markers, kind, n):
  tok, ids = tokenizer_and_tokens()
  model = tiny_model(seed=1)
  prompts = [latent.prompt_ids(tok, ch.question, ids, markers=markers, kind=kind, n_thoughts=n)[0] for ch in chains()]
  out = latent.latent_generate(model, prompts, thoughts=n, eot=ids.eot if markers else None, eos=ids.eos,
                               pad=ids.pad, max_new_tokens=G)
  assert out.tokens.shape == (3, G) and out.thoughts.shape == (3, n, model.cfg.hidden_size)
  # Feed the generated tokens back as the suffix of training rows with n thoughts each.
  examples = []
  for p, gen, length in zip(prompts, out.tokens, out.lengths):
    suffix = np.concatenate([[ids.eot] if markers else [], gen[:length]]).astype(np.int32)
    examples.append(latent.StageExample(prompt=p, n_thoughts=n, kind=kind, suffix=suffix,
                                        suffix_loss=np.ones(len(suffix), bool), answer=""))
  layout = latent.Layout.fit(examples)
  rows = latent.make_rows(examples, layout, ids)
  h = latent.latent_hidden(model, *(jnp.asarray(rows[k]) for k in ("tokens", "positions", "segment_ids",
                                                                      "thought_mask")),
                           prefix=layout.prefix, thoughts=layout.thoughts)
  greedy = np.asarray(jnp.argmax(jnp.einsum("btd,dv->btv", h, model.unembed_matrix()), axis=-1))
  end = layout.prefix + layout.thoughts
  first = 1 if markers else 0  # <eot> is fed, not predicted
  for r, (gen, length) in enumerate(zip(out.tokens, out.lengths)):
    # Column end - 1 + i predicts suffix token i; the generated tokens sit after <eot>.
    cols = end - 1 + first + np.arange(length)
    np.testing.assert_array_equal(greedy[r, cols], gen[:length])
    # The decoder's thoughts are the training forward's hidden states at the columns before each thought.
    np.testing.assert_allclose(out.thoughts[r], np.asarray(h[r, end - n - 1:end - 1]), atol=1e-5, rtol=1e-5)
  assert (out.lengths >= 1).all()
