"""The <eot> classifier head: its loss against numpy, and decoding that stops when it fires."""

import jax.numpy as jnp
import numpy as np
import pytest
from latent_testlib import CFG, chains, tiny_model, tokenizer_and_tokens

from jaxrl import latent

G = 4


def test_eot_head_loss_matches_numpy():
  tok, ids = tokenizer_and_tokens()
  examples = [latent.stage_example(ch, 2, c=1, tokenizer=tok, tokens=ids) for ch in chains()]
  rows, used = latent.pack_rows(examples, latent.PackedLayout(first=96, examples=3, thoughts=2, last=64), ids,
                                num_rows=2)
  assert used == 3
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(*rows["tokens"].shape, CFG.hidden_size)).astype(np.float32)
  head = {"w": jnp.asarray(rng.normal(size=CFG.hidden_size), jnp.float32), "b": jnp.asarray(0.3, jnp.float32)}
  prepared = latent.token_mean_prepare({k: jnp.asarray(v) for k, v in rows.items()})
  got = latent.eot_loss(latent.eot_logits(head, jnp.asarray(hidden)), prepared["eot_label"], prepared["eot_weights"])
  # Reference from the tokens alone: per example, <bot> and its thoughts decide; the last one says stop.
  terms = []
  for r in range(rows["tokens"].shape[0]):
    for col in np.flatnonzero(rows["tokens"][r] == ids.bot):
      n = 0
      while rows["thought_mask"][r, col + 1 + n]:
        n += 1
      for j, c in enumerate(range(col, col + n + 1)):
        z = float(hidden[r, c] @ np.asarray(head["w"]) + 0.3)
        p = 1 / (1 + np.exp(-z))
        terms.append(-np.log(p) if j == n else -np.log(1 - p))
  assert len(terms) == sum(e.n_thoughts + 1 for e in examples)
  np.testing.assert_allclose(float(got), np.mean(terms), rtol=1e-5)


@pytest.fixture(scope="module")
def decoded():
  tok, ids = tokenizer_and_tokens()
  model = tiny_model(seed=2)
  prompts = [latent.prompt_ids(tok, ch.question, ids, markers=True, kind="latent", n_thoughts=3)[0]
             for ch in chains()] * 2
  run = lambda n, head=None: latent.latent_generate(model, prompts, thoughts=n, eot=ids.eot, eos=ids.eos,
                                                    pad=ids.pad, max_new_tokens=G, eot_head=head)
  return run, {n: run(n) for n in range(4)}


def _head(w, b):
  return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


@pytest.mark.parametrize("bias,count", [(-1e9, 3), (1e9, 0)])
def test_forced_classifier_equals_fixed_count(decoded, bias, count):
  run, fixed = decoded
  out = run(3, _head(np.zeros(CFG.hidden_size), bias))
  np.testing.assert_array_equal(out.n_thoughts, count)
  np.testing.assert_array_equal(out.tokens, fixed[count].tokens)
  np.testing.assert_allclose(out.thoughts[:, :count], fixed[count].thoughts, atol=1e-5)


def test_classifier_stops_rows_at_their_own_count(decoded):
  """A head that fires at different steps per row: each row equals the fixed-count decode of its count."""
  run, fixed = decoded
  w = np.random.default_rng(1).normal(size=CFG.hidden_size)
  z = fixed[3].thoughts @ w  # [B, 3]: the head's logit (bias 0) before each thought
  zs = np.sort(z.ravel())
  i = max(range(len(zs) // 4, 3 * len(zs) // 4), key=lambda i: zs[i + 1] - zs[i])
  bias = -float(zs[i] + zs[i + 1]) / 2  # a threshold far from every logit, near the median
  want = np.asarray([next((j for j in range(3) if z[r, j] + bias > 0), 3) for r in range(z.shape[0])])
  assert len(set(want.tolist())) > 1, want  # the rows really stop at different counts
  out = run(3, _head(w, bias))
  np.testing.assert_array_equal(out.n_thoughts, want)
  for r, n in enumerate(want):
    np.testing.assert_array_equal(out.tokens[r], fixed[n].tokens[r], err_msg=f"row {r} ({n} thoughts)")
