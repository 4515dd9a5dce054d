"""The train step: accumulation equals one big batch, the non-finite guard, shardings kept, rows split as the
sharding rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import sharding, train


def _problem(seed=0, rows=16, d=6):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, d)).astype(np.float32)
  y = rng.normal(size=(rows,)).astype(np.float32)
  w = rng.uniform(0.1, 1.0, size=(rows,)).astype(np.float32)
  w = w / w.sum()  # global normaliser folded into per-row weights
  params = {"w": jnp.asarray(rng.normal(size=(d,)), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  return params, {"x": x, "y": y, "w": w}


def _loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  per_row = (pred - batch["y"]) ** 2
  return jnp.sum(batch["w"] * per_row), {"weight": jnp.sum(batch["w"])}


def _reference_grads(params, batch):
  x, y, w = (np.asarray(batch[k], np.float64) for k in ("x", "y", "w"))
  pw, pb = np.asarray(params["w"], np.float64), float(params["b"])
  r = x @ pw + pb - y
  return {"w": (2 * w * r) @ x, "b": np.sum(2 * w * r)}, np.sum(w * r * r)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_accumulated_gradients_equal_float64_reference(micro):
  params, batch = _problem()
  loss, grads, metrics = jax.jit(
      lambda p, b: train.accumulate_gradients(_loss, p, b, micro_batches=micro))(params, batch)
  ref_grads, ref_loss = _reference_grads(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for k in ref_grads:
    np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["weight"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("devices,micro", [(1, 1), (2, 2), (4, 4), (8, 2)])
def test_sharded_step_is_split_invariant(devices, micro):
  params, batch = _problem()
  opt = train.make_optimizer(train.OptimConfig(lr=0.1, warmup_steps=0, schedule="constant"), 10)
  mesh = sharding.make_mesh({"data": devices}, devices=jax.devices()[:devices])
  placed = jax.device_put(batch, NamedSharding(mesh, P(("data",))))
  state = train.init_train_state(params, opt)
  step = train.make_train_step(_loss, opt, micro_batches=micro, mesh=mesh, donate=False)
  new_state, metrics = step(state, placed)

  ref_step = train.make_train_step(_loss, opt, donate=False)
  ref_state, ref_metrics = ref_step(state, batch)
  for k in params:
    np.testing.assert_allclose(new_state.params[k], ref_state.params[k], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  assert int(new_state.step) == 1 and int(new_state.skipped) == 0


def test_non_finite_gradient_skips_update_and_counts():
  params, batch = _problem()
  batch = dict(batch, y=batch["y"].copy())
  batch["y"][3] = np.nan
  opt = train.make_optimizer(train.OptimConfig(lr=0.1), 10)
  state = train.init_train_state(params, opt)
  new_state, metrics = train.make_train_step(_loss, opt, donate=False)(state, batch)
  assert int(new_state.skipped) == 1 and int(new_state.step) == 0
  assert int(metrics["skipped"]) == 1
  for k in params:
    np.testing.assert_array_equal(new_state.params[k], params[k])
  opt_leaves = jax.tree.leaves(new_state.opt_state)
  assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in opt_leaves)


def test_schedule_warmup_then_cosine_to_final_ratio():
  cfg = train.OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", final_lr_ratio=0.1)
  sched = train.make_schedule(cfg, 110)
  np.testing.assert_allclose([sched(0), sched(5), sched(10), sched(60), sched(110)],
                             [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1], rtol=1e-6, atol=1e-7)


def test_optim_config_rejects_bad_values_naming_the_key():
  with pytest.raises(ValueError, match="optim.lr"):
    train.OptimConfig(lr=0.0)
  with pytest.raises(ValueError, match="optim.clip_norm"):
    train.OptimConfig(clip_norm=-1.0)


@pytest.mark.parametrize("devices,micro", [(2, 4), (8, 2)])
def test_prepare_folds_global_normaliser_before_the_split(devices, micro):
  params, batch = _problem()
  raw = dict(batch, w=np.arange(1, 17, dtype=np.float32))

  def prepare(b):
    return dict(b, w=b["w"] / jnp.sum(b["w"]))

  opt = train.make_optimizer(train.OptimConfig(lr=0.1, schedule="constant"), 10)
  state = train.init_train_state(params, opt)
  mesh = sharding.make_mesh({"data": devices}, devices=jax.devices()[:devices])
  placed = jax.device_put(raw, NamedSharding(mesh, P(("data",))))
  split_state, _ = train.make_train_step(_loss, opt, micro_batches=micro, mesh=mesh, prepare=prepare,
                                         donate=False)(state, placed)
  whole = dict(raw, w=raw["w"] / raw["w"].sum())
  ref_state, _ = train.make_train_step(_loss, opt, donate=False)(state, whole)
  for k in params:
    np.testing.assert_allclose(split_state.params[k], ref_state.params[k], rtol=1e-5, atol=1e-7)


def test_sharded_step_keeps_the_state_shardings():
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  params, batch = _problem(d=8)
  params = jax.device_put(params, {"w": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P())})
  opt = train.make_optimizer(train.OptimConfig(lr=0.1, warmup_steps=0, schedule="constant"), 10)
  state = train.place_on_mesh(train.init_train_state(params, opt), mesh)
  want = jax.tree.map(lambda x: x.sharding, state)
  step = train.make_train_step(_loss, opt, micro_batches=2, mesh=mesh, state_sharding=want, donate=False)
  new_state, _ = step(state, jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp")))))
  flat_new = jax.tree_util.tree_leaves_with_path(new_state)
  flat_want = jax.tree.leaves(want)
  assert len(flat_new) == len(flat_want) and new_state.params["w"].sharding.spec == P("fsdp")
  for (path, leaf), sh in zip(flat_new, flat_want):
    assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (jax.tree_util.keystr(path), leaf.sharding, sh)


@pytest.mark.parametrize("batch_rule, want", [(("data", "fsdp"), P(None, ("data", "fsdp"))), ("data", P(None, "data"))])
def test_micro_batch_rows_follow_the_batch_rule(batch_rule, want):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  rules = sharding.LogicalRules.from_mapping({**dict(sharding.LogicalRules.default().rules), "batch": batch_rule})
  x = jax.device_put(np.arange(32 * 3, dtype=np.float32).reshape(32, 3), NamedSharding(mesh, P(("data", "fsdp"))))
  micro = jax.jit(lambda b: train.split_micro_batches(b, 2, mesh=mesh, rules=rules))(x)
  assert micro.sharding.is_equivalent_to(NamedSharding(mesh, want), 3), micro.sharding
  np.testing.assert_array_equal(micro[1], np.asarray(x)[1::2])


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_by_global_norm_matches_optax(max_norm):
  """jaxrl's clip (one scalar factor, fused into Adam's moments: no second gradient tree in the step's
  temporaries) gives optax's clipped values up to one rounding and the same (empty) state."""
  from jaxrl.train._optim import clip_by_global_norm
  rng = np.random.default_rng(0)
  g = {"a": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32), "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
  ours, theirs = clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
  assert jax.tree.structure(ours.init(g)) == jax.tree.structure(theirs.init(g))
  got, _ = jax.jit(ours.update)(g, ours.init(g))
  want, _ = theirs.update(g, theirs.init(g))
  for k in g:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=0)
  if max_norm > 10:  # under the threshold the gradients pass unchanged
    for k in g:
      np.testing.assert_array_equal(got[k], g[k])
