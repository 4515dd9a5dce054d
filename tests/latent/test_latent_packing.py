"""Packed latent rows: several examples per row give each example's own loss and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from latent_testlib import chains, tiny_model, tokenizer_and_tokens

from jaxrl import latent

KEYS = ("tokens", "positions", "segment_ids", "thought_mask")


def _examples(stage=2):
  tok, ids = tokenizer_and_tokens()
  return [latent.stage_example(ch, stage, c=1, tokenizer=tok, tokens=ids) for ch in chains()]


def _token_nll(model, hidden, rows):  # [B, T]
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", hidden, model.unembed_matrix()), axis=-1)
  return -jnp.take_along_axis(logp, rows["targets"][..., None], axis=-1)[..., 0] * rows["loss_mask"]


def _packed_losses(graphdef, layout, params, rows):  # [3]: per-example mean NLL of the one packed row
  model = nnx.merge(graphdef, params)
  h = latent.packed_latent_hidden(model, rows, thoughts=layout.thoughts, examples=layout.examples)
  nll, mask, seg = _token_nll(model, h, rows)[0], rows["loss_mask"][0], rows["segment_ids"][0]
  return jnp.stack([jnp.sum(jnp.where(seg == i, nll, 0)) / jnp.sum(jnp.where(seg == i, mask, 0)) for i in (1, 2, 3)])


def _alone_losses(graphdef, layout, params, rows):  # [3]: each example alone in its own aligned row
  model = nnx.merge(graphdef, params)
  h = latent.latent_hidden(model, *(rows[k] for k in KEYS), prefix=layout.prefix, thoughts=layout.thoughts)
  return jnp.sum(_token_nll(model, h, rows), axis=1) / jnp.sum(rows["loss_mask"], axis=1)


def _sum_with_parts(fn):
  return jax.jit(jax.value_and_grad(lambda p, rows: (jnp.sum(fn(p, rows)), fn(p, rows)), has_aux=True))


def test_packed_row_equals_each_example_alone():
  """One packed row of 3 examples (2, 1 and 2 thoughts): per-example losses and the gradient of their sum
  equal those of the examples computed alone (one per aligned row, :func:`latent_hidden`)."""
  _, ids = tokenizer_and_tokens()
  examples = _examples()
  n = max(e.n_thoughts for e in examples)
  needs = np.asarray([latent.PackedLayout(first=0, examples=1, thoughts=n, last=0).needs(e) for e in examples])
  layout = latent.PackedLayout(first=int(needs[:, 0].sum()) + 2, examples=3, thoughts=n,
                               last=int(needs[:, 1].sum()) + 3)
  rows, used = latent.pack_rows(examples, layout, ids, num_rows=1)
  assert used == 3 and rows["tokens"].shape == (1, layout.length) and set(rows["segment_ids"][0]) == {0, 1, 2, 3}
  np.testing.assert_array_equal(np.sort(rows["order"][0]), np.arange(layout.length))  # a permutation
  graphdef, params = nnx.split(tiny_model())
  (_, losses), grads = _sum_with_parts(functools.partial(_packed_losses, graphdef, layout))(
      params, {k: jnp.asarray(v) for k, v in rows.items()})
  aligned = latent.Layout.fit(examples)
  alone = {k: jnp.asarray(v) for k, v in latent.make_rows(examples, aligned, ids).items()}
  (_, want), want_grads = _sum_with_parts(functools.partial(_alone_losses, graphdef, aligned))(params, alone)
  np.testing.assert_allclose(np.asarray(losses), np.asarray(want), rtol=1e-5, atol=1e-5)
  for (path, got), (_, ref) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
    got, ref = np.asarray(got.get_value()), np.asarray(ref.get_value())
    assert np.abs(ref).max() > 0, path
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5, err_msg=str(path))


def test_packing_cuts_padding_and_keeps_every_token():
  """Stage-2 arithmetic examples: packed rows hold every example token once, with less padding than the
  trainer's shared aligned layout (the numbers are in docs/latent.md)."""
  tok, ids = tokenizer_and_tokens()
  chain_list = latent.arithmetic_chains(64, seed=0, difficulty=2)
  stages = {k: [latent.stage_example(ch, k, c=1, tokenizer=tok, tokens=ids, pad_thoughts=True) for ch in chain_list]
            for k in range(3)}
  shared = latent.Layout.fit(e for ex in stages.values() for e in ex)
  for k, examples in stages.items():
    layout = latent.PackedLayout.fit(examples, 256)
    rows, used = latent.pack_rows(examples, layout, ids)
    assert used == len(examples) and rows["tokens"].shape[1] == layout.length == 256
    aligned = latent.make_rows(examples, shared, ids)
    assert (rows["segment_ids"] > 0).sum() == (aligned["segment_ids"] > 0).sum()
    assert rows["loss_mask"].sum() == aligned["loss_mask"].sum() and rows["eot_mask"].sum() == aligned["eot_mask"].sum()
    assert latent.padding_fraction(rows) < latent.padding_fraction(aligned), k
    # Every gathered column appears once across the passes, and only real columns are gathered.
    cols = np.concatenate([rows[key] for key in ("first_idx", "mid_idx", "last_idx")], axis=1)
    for r in range(len(cols)):
      real = cols[r][cols[r] >= 0]
      assert len(set(real.tolist())) == len(real) == (rows["segment_ids"][r] > 0).sum()
      assert (rows["segment_ids"][r, real] > 0).all()


def test_packed_stage_one_values():
  """N = 1 (no thought pass between pass 0 and the final pass): per-example losses as alone."""
  _, ids = tokenizer_and_tokens()
  examples = _examples(stage=1)
  layout = latent.PackedLayout(first=96, examples=3, thoughts=1, last=64)
  rows, used = latent.pack_rows(examples, layout, ids, num_rows=1)
  assert used == 3
  graphdef, params = nnx.split(tiny_model())
  rows = {k: jnp.asarray(v) for k, v in rows.items()}
  got = jax.jit(functools.partial(_packed_losses, graphdef, layout))(params, rows)
  aligned = latent.Layout.fit(examples)
  alone = {k: jnp.asarray(v) for k, v in latent.make_rows(examples, aligned, ids).items()}
  want = jax.jit(functools.partial(_alone_losses, graphdef, aligned))(params, alone)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
