"""``optim.lr_multipliers``: per-module learning rates by parameter path, checked against a float64 numpy AdamW;
the first matching regex wins, Adam's moments are the unscaled ones, no optimizer state is added, bad keys are
refused with the key named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import models, train

_MULT = {"visual/merger": 10.0, "visual": 0.1}  # merger 10×, rest of the tower 0.1× (first match wins), LM 1×


@pytest.fixture(scope="module")
def vl_params():
  cfg = models.ModelConfig.tiny_vl(dtype="float32", param_dtype="float32")
  _, params = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
  return params


def _flat(tree) -> dict[str, np.ndarray]:
  return {train.param_path(p): np.asarray(x, np.float64) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _factor(name: str) -> float:
  return 10.0 if name.startswith("visual/merger") else 0.1 if name.startswith("visual") else 1.0


def _numpy_adamw(params, grads_per_step, *, lr, clip, wd, b1=0.9, b2=0.999, eps=1e-8):
  """Float64 clip → Adam → decoupled decay (matrices only) → ``-lr · factor(path)``, moments never scaled."""
  p = dict(params)
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  for t, g in enumerate(grads_per_step, 1):
    norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
    c = min(1.0, clip / norm)
    for k in p:
      gk = g[k] * c
      m[k] = b1 * m[k] + (1 - b1) * gk
      v2[k] = b2 * v2[k] + (1 - b2) * gk * gk
      u = (m[k] / (1 - b1**t)) / (np.sqrt(v2[k] / (1 - b2**t)) + eps)
      if p[k].ndim > 1:
        u = u + wd * p[k]
      p[k] = p[k] - lr * _factor(k) * u
  return p


def test_two_adamw_steps_equal_a_float64_reference(vl_params):
  """Matched parameters move by exactly factor × the unscaled update, every step (step 2 reads the moments)."""
  cfg = train.OptimConfig(lr=1e-3, schedule="constant", clip_norm=0.5, weight_decay=0.01, lr_multipliers=_MULT)
  opt = train.make_optimizer(cfg, 10)
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), vl_params) for _ in range(2)]
  params, state = vl_params, opt.init(vl_params)
  for g in grads:
    updates, state = jax.jit(opt.update)(g, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  start = _flat(vl_params)
  ref = _numpy_adamw(start, [_flat(g) for g in grads], lr=1e-3, clip=0.5, wd=0.01)
  got = _flat(params)
  assert {_factor(k) for k in got} == {10.0, 0.1, 1.0}
  for k, want in ref.items():  # the displacement over 2 steps: ~2·lr·factor; float32 rounding ≪ 1e-3 of it
    np.testing.assert_allclose(got[k] - start[k], want - start[k], rtol=1e-3, atol=1e-3 * 1e-3 * _factor(k),
                               err_msg=k)


def test_updates_scale_exactly_and_state_is_unchanged(vl_params):
  """Against the same optimizer without multipliers: updates × factor, identical (Adam) state structure."""
  cfg = train.OptimConfig(lr=1e-3, schedule="constant")
  plain, scaled = train.make_optimizer(cfg, 10), train.make_optimizer(
      train.OptimConfig(lr=1e-3, schedule="constant", lr_multipliers=_MULT), 10)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.3, jnp.float32), vl_params)
  u_plain, s_plain = plain.update(grads, plain.init(vl_params), vl_params)
  u_scaled, s_scaled = scaled.update(grads, scaled.init(vl_params), vl_params)
  for (k, a), b in zip(_flat(u_plain).items(), _flat(u_scaled).values()):
    np.testing.assert_allclose(b, a * _factor(k), rtol=1e-6, err_msg=k)
  assert jax.tree.structure(s_plain) == jax.tree.structure(s_scaled)  # checkpoints and plans unchanged
  assert jax.eval_shape(scaled.init, vl_params) == jax.eval_shape(plain.init, vl_params)  # as `jaxrl plan` does
  for a, b in zip(jax.tree.leaves(s_plain), jax.tree.leaves(s_scaled)):
    np.testing.assert_array_equal(a, b)


def test_multipliers_combine_with_the_lora_plus_scale():
  tree = {"layers": {"q_lora_a": jnp.ones((2, 3)), "q_lora_b": jnp.ones((3, 2))}}
  cfg = train.OptimConfig(lr=1.0, schedule="constant", clip_norm=None, lr_multipliers={"lora_b$": 0.5})
  opt = train.make_optimizer(cfg, 1, lr_scale={"layers": {"q_lora_a": 1.0, "q_lora_b": 4.0}})
  u, _ = opt.update(tree, opt.init(tree), tree)
  np.testing.assert_allclose(u["layers"]["q_lora_a"], -1.0, rtol=1e-4)  # Adam's first step: g / |g| (float32)
  np.testing.assert_allclose(u["layers"]["q_lora_b"], -2.0, rtol=1e-4)  # 4 × 0.5


def test_yaml_order_is_kept_through_overrides(tmp_path):
  """First match wins, so the loader keeps the file's order (``apply_overrides`` once sorted the keys)."""
  path = tmp_path / "optim.yaml"
  path.write_text("lr_multipliers: {visual/merger: 3.0, visual: 0.1}\n")
  cfg = config_lib.load(train.OptimConfig, path, ["lr=0.01"])
  assert list(cfg.lr_multipliers) == ["visual/merger", "visual"]


def test_config_loader_and_bad_keys():
  cfg = config_lib.from_dict(train.OptimConfig, {"lr": 1e-3, "lr_multipliers": {"visual": 0.1}}, prefix="optim")
  assert cfg.lr_multipliers == {"visual": 0.1}
  with pytest.raises(config_lib.ConfigError, match=r"optim.lr_multipliers.visual: expected a float"):
    config_lib.from_dict(train.OptimConfig, {"lr_multipliers": {"visual": "x"}}, prefix="optim")
  with pytest.raises(ValueError, match=r"lr_multipliers\['visual'\].*freeze_vision"):
    train.OptimConfig(lr_multipliers={"visual": 0.0})
  with pytest.raises(ValueError, match=r"'visual\(' is not a regular expression"):
    train.OptimConfig(lr_multipliers={"visual(": 2.0})
  opt = train.make_optimizer(train.OptimConfig(lr_multipliers={"layers": 2.0, "vision_tower": 0.1}), 10)
  with pytest.raises(ValueError, match=r"'vision_tower' matches no trainable parameter \(paths: .*layers/w"):
    opt.init({"layers": {"w": jnp.ones((2, 2))}})


def test_param_path():
  tree = {"visual": {"blocks": [{"qkv": nnx.Param(jnp.ones(2))}]}}
  assert [train.param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]] == ["visual/blocks/0/qkv"]
