"""The KV-cache latent loop against a naive unrolled reference: values, gradients, finite differences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from latent_testlib import CFG, chains, nll, tiny_model, tokenizer_and_tokens, unrolled_hidden

from jaxrl import latent

KEYS = ("tokens", "positions", "segment_ids", "thought_mask")


@pytest.fixture(scope="module")
def setup():
  tok, ids = tokenizer_and_tokens()
  examples = [latent.stage_example(ch, 2, c=1, tokenizer=tok, tokens=ids) for ch in chains()]
  assert [e.n_thoughts for e in examples] == [2, 1, 2]  # one row with fewer thoughts than the layout's N
  layout = latent.Layout.fit(examples)
  rows = {k: jnp.asarray(v) for k, v in latent.make_rows(examples, layout, ids).items()}
  graphdef, params = nnx.split(tiny_model())
  cached = jax.jit(jax.value_and_grad(functools.partial(_cached_loss, graphdef, layout)))
  return graphdef, params, layout, rows, cached, cached(params, rows)


SHARP = ("q_proj", "k_proj", "lm_head")


def _sharpen(params, scale: float):
  """``params`` with q/k/lm_head scaled. At init (weights ~0.01) attention is nearly uniform, so a thought
  fed at the wrong column or RoPE position barely moves the outputs (a thought pass run at position - 1
  moved the gradients by 5e-5 at init, the loss by 8e-3 with scale 20)."""
  def hit(path):
    return any(getattr(k, "key", None) in SHARP for k in path)

  assert sum(hit(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)) == len(SHARP)
  return jax.tree_util.tree_map_with_path(lambda path, x: x * scale if hit(path) else x, params)


def _cached_loss(graphdef, layout, params, rows):
  model = nnx.merge(graphdef, params)
  h = latent.latent_hidden(model, *(rows[k] for k in KEYS), prefix=layout.prefix, thoughts=layout.thoughts)
  return nll(model, h, rows)


@pytest.fixture(scope="module")
def unrolled(setup):
  graphdef, _, layout, rows, _, _ = setup

  def loss(params):
    model = nnx.merge(graphdef, params)
    return nll(model, unrolled_hidden(model, rows, layout.thoughts), rows)

  return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("scale", [1.0, 20.0])  # 20: sharp attention, sensitive to thought positions
def test_latent_loop_matches_unrolled_reference(setup, unrolled, scale):
  _, params, _, rows, cached, (loss_c, grads_c) = setup
  if scale != 1.0:
    params = _sharpen(params, scale)
    loss_c, grads_c = cached(params, rows)
  loss_u, grads_u = unrolled(params)
  np.testing.assert_allclose(float(loss_c), float(loss_u), rtol=1e-6, atol=1e-6)
  flat_c, flat_u = nnx.to_flat_state(grads_c), nnx.to_flat_state(grads_u)
  assert [p for p, _ in flat_c] == [p for p, _ in flat_u]
  for (path, gc), (_, gu) in zip(flat_c, flat_u):
    gc, gu = np.asarray(gc.get_value()), np.asarray(gu.get_value())
    assert np.abs(gc).max() > 0, path
    np.testing.assert_allclose(gc, gu, atol=1e-5, rtol=1e-5, err_msg=str(path))


def test_thought_columns_take_hidden_states(setup):
  """With the thought mask cleared the same rows give another loss: the thoughts are really fed back."""
  _, params, _, rows, cached, (loss, _) = setup
  plain, _ = cached(params, dict(rows, thought_mask=jnp.zeros_like(rows["thought_mask"])))
  assert abs(float(loss) - float(plain)) > 1e-4


def test_latent_loss_finite_difference(setup):
  _, params, _, rows, cached, (_, grads) = setup
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  noise = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
  unit = lambda tree: jax.tree.map(lambda x: x / jnp.sqrt(sum(jnp.sum(y * y) for y in jax.tree.leaves(tree))), tree)
  direction = unit(jax.tree.map(jnp.add, unit(grads), unit(noise)))  # half along the gradient, half random
  eps = 1e-3
  plus, _ = cached(jax.tree.map(lambda p, d: p + eps * d, params, direction), rows)
  minus, _ = cached(jax.tree.map(lambda p, d: p - eps * d, params, direction), rows)
  fd = (float(plus) - float(minus)) / (2 * eps)
  analytic = float(sum(jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction))))
  assert CFG.dtype == "float32" and abs(analytic) > 0.1
  np.testing.assert_allclose(fd, analytic, rtol=1e-3)


def test_embeds_override_equals_token_embedding_where_masked():
  model = tiny_model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 5)), jnp.int32)
  pos, seg = jnp.broadcast_to(jnp.arange(5), (2, 5)), jnp.ones((2, 5), jnp.int32)
  plain = model(tokens, positions=pos, segment_ids=seg)
  mask = jnp.asarray([[True, False, True, False, True], [False] * 5])
  same = model(tokens, positions=pos, segment_ids=seg, embeds=model.embed[...][tokens], embeds_mask=mask)
  np.testing.assert_allclose(np.asarray(same), np.asarray(plain), atol=1e-6)
  other = model(tokens, positions=pos, segment_ids=seg, embeds=jnp.zeros((2, 5, CFG.hidden_size)), embeds_mask=mask)
  np.testing.assert_allclose(np.asarray(other[1]), np.asarray(plain[1]), atol=1e-6)  # row without a mask
  assert not np.allclose(np.asarray(other[0, 0]), np.asarray(plain[0, 0]))
  with pytest.raises(ValueError, match="embeds and embeds_mask must be given together"):
    model(tokens, positions=pos, segment_ids=seg, embeds=jnp.zeros((2, 5, CFG.hidden_size)))
