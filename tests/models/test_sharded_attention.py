"""Pallas attention inside sharded programs (shard_map wrapper) and batch-sharded activations under FSDP.

The Pallas kernels run in interpret mode on the 8-device CPU mesh, inside the model's jitted train
step (``train.make_train_step``), and must give the XLA reference's loss and gradients on one device.
Interpret mode is slow, so the model is one layer over 16 tokens.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl import kernels, losses, models, sharding, train

CFG = models.ModelConfig.tiny(num_layers=1, vocab_size=64)  # N=4 heads over K=2 kv heads, head_dim 16
B, T = 8, 16
MESHES = {"data8": {"data": 8}, "fsdp8": {"fsdp": 8}, "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2}}
CASES = [(m, "pallas_triton") for m in MESHES] + [("data2_fsdp2_tensor2", "pallas_tpu")]


def _batch():
  rng = np.random.default_rng(0)
  seg = np.repeat(np.array([[1] * 9 + [2] * 5 + [0] * 2], np.int32), B, 0)
  pos = np.repeat(np.array([list(range(9)) + list(range(5)) + [0, 0]], np.int32), B, 0)
  return dict(tokens=jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32),
              positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))


def _pallas_inside_shard_map(jaxpr, inside: bool = False) -> bool:
  """Whether a ``pallas_call`` occurs in the body of a ``shard_map`` (searching nested jaxprs)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call" and inside:
      return True
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns") and _pallas_inside_shard_map(sub, inside or eqn.primitive.name == "shard_map"):
          return True
  return False


def _sgd_step(cfg, mesh):
  """Loss and gradient (= params − params' for SGD at lr 1) of one jitted train step."""
  model = models.init_model(cfg, mesh=mesh, seed=0)
  graphdef, params = nnx.split(model)

  def loss_fn(params, mb):
    m = nnx.merge(graphdef, params)
    h = m(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"], return_hidden=True)
    lp = losses.token_logprobs(h, m.unembed_matrix(), jnp.roll(mb["tokens"], -1, 1), chunk_size=64)
    return -jnp.sum(jnp.where(mb["segment_ids"] > 0, lp, 0.0)) / 100.0, {}

  opt = optax.sgd(1.0)
  step = train.make_train_step(loss_fn, opt, mesh=mesh, donate=False)
  batch = _batch()
  if mesh is not None:
    batch = jax.device_put(batch, sharding.batch_sharding(mesh))
  state = train.init_train_state(params, opt)
  if mesh is not None:  # the kernel runs inside a shard_map (interpret mode would also partition without)
    assert _pallas_inside_shard_map(jax.make_jaxpr(step)(state, batch).jaxpr), "pallas_call outside shard_map"
  new, out = step(state, batch)
  grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
  return float(out["loss"]), {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(grads)}


@functools.lru_cache(maxsize=1)
def _reference():
  return _sgd_step(dataclasses.replace(CFG, attention_impl="reference"), None)


@pytest.mark.parametrize("mesh_name,impl", CASES)
def test_sharded_pallas_attention_in_the_train_step_equals_the_reference(mesh_name, impl):
  want_loss, want = _reference()
  cfg = dataclasses.replace(CFG, attention_impl=impl, attention_interpret=True)
  loss, got = _sgd_step(cfg, sharding.make_mesh(MESHES[mesh_name]))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_sharded_attention_splits_rows_and_heads_and_repeats_indivisible_kv_heads():
  """(fsdp=2, tensor=4): 4 query heads split 4 ways, 2 kv heads repeated per query head; values equal."""
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(4, 8, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(4, 8, 2, 16)), jnp.float32) for _ in range(2))
  seg = jnp.asarray(np.array([[1] * 5 + [2] * 3] * 4), jnp.int32)
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  fn = jax.jit(lambda q, k, v: kernels.sharded_attention(
      q, k, v, segment_ids=seg, mesh=mesh, batch_axes=("data", "fsdp"), head_axes=("tensor",)))
  out = fn(q, k, v)
  assert tuple(out.sharding.spec)[:3] == ("fsdp", None, "tensor")
  np.testing.assert_allclose(np.asarray(out), np.asarray(kernels.attention(q, k, v, segment_ids=seg)),
                             rtol=1e-5, atol=1e-6)


def test_a_split_sequence_is_refused_with_a_clear_error():
  mesh = sharding.make_mesh({"sequence": 2, "data": 4})
  q = jnp.zeros((4, 8, 2, 16), jnp.float32)
  with pytest.raises(NotImplementedError, match="sequence is split over mesh axes"):
    kernels.sharded_attention(q, q, q, segment_ids=jnp.ones((4, 8), jnp.int32), mesh=mesh,
                              batch_axes=("data",), sequence_axes=("sequence",))


def test_fsdp_residual_stream_is_batch_sharded_and_no_activation_is_all_reduced():
  """Under (fsdp=8) the hidden states come out split by rows, and the compiled forward + backward
  all-reduces only weight-sized arrays (never a ``[B, T, ...]`` activation)."""
  cfg = dataclasses.replace(CFG, num_layers=2)
  mesh = sharding.make_mesh(MESHES["fsdp8"])
  model = models.init_model(cfg, mesh=mesh, seed=0)
  assert model.placement == models.Placement(mesh, sharding.LogicalRules.default())
  graphdef, params = nnx.split(model)
  batch = jax.device_put(_batch(), sharding.batch_sharding(mesh))

  def loss(params, batch):
    m = nnx.merge(graphdef, params)
    h = m(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"], return_hidden=True)
    return jnp.sum(losses.token_logprobs(h, m.unembed_matrix(), batch["tokens"], chunk_size=32)), h

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, hidden), _ = fn(params, batch)
  assert hidden.sharding.spec[0] == "fsdp" and all(s is None for s in hidden.sharding.spec[1:])
  hlo = fn.lower(params, batch).compile().as_text()
  reduced = re.findall(r"= \w+\[([\d,]*)\][^=\n]*? all-reduce\(", hlo)
  assert reduced, "expected weight-gradient all-reduces"
  activations = [s for s in reduced if s.startswith(f"{B},{T},")]
  assert not activations, f"activation-sized all-reduces: {activations}"
