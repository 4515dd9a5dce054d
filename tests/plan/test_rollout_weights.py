"""The rollout engine reads a compute-dtype copy of the float32 master weights (``RLTrainer.sampling_model``),
and ``jaxrl plan`` counts that copy beside the master weights; per-target recipe variants (``plan.overrides``)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import plan, rl

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REAL = ["deepscaler_1p5b", "areal_1p5b", "dapo_qwen2p5_7b", "deepcoder_14b_grpo_plus"]


def _floats(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_engine_reads_a_bfloat16_copy_of_float32_master_weights(tmp_path):
  cfg = plan.load_recipe(str(CONFIGS / "grpo_tiny.yaml"), [
      "model.overrides.dtype=bfloat16", f"out_dir={tmp_path}", "tensorboard=false", "eval.every=0",
      "rollout.engine.num_slots=8", "rollout.prompts_per_step=2", "rollout.n=4", "algorithm.mini_batches=1",
      "micro_batch.token_budget=768"])
  trainer = rl.RLTrainer(cfg)
  try:
    engine = trainer._sampler_for(1)
    assert {x.dtype for x in _floats(trainer.state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in _floats(engine.params)} == {jnp.dtype(jnp.bfloat16)}
    # the copy holds the master weights rounded to bf16 (the same values the bf16 forward casts them to)
    master, copy = _floats(trainer.state.params), _floats(nnx.state(trainer.sampling_model()))
    assert len(master) == len(copy)
    for m, c in zip(master, copy):
      np.testing.assert_array_equal(np.asarray(m.astype(jnp.bfloat16), np.float32), np.asarray(c, np.float32))
    trainer.state = trainer.state._replace(params=jax.tree.map(lambda x: x + 1, trainer.state.params))
    trainer._sampler_for(1)  # set_weights: a new bf16 copy of the new master weights
    assert {x.dtype for x in _floats(engine.params)} == {jnp.dtype(jnp.bfloat16)}
    first = _floats(engine.params)[0]
    np.testing.assert_array_equal(np.asarray(first, np.float32),
                                  np.asarray(_floats(trainer.state.params)[0].astype(jnp.bfloat16), np.float32))
  finally:
    trainer.close()


def test_plan_counts_the_compute_dtype_copy_beside_the_master_weights():
  """bf16 compute: the engine's programs read bf16 weights (half the float32 bytes) and the float32 master
  weights sit beside them; float32 compute: the engine reads the master weights, nothing is copied."""
  from jaxrl.plan._measure import model_config
  from jaxrl.plan._programs import build_context, device_bytes, rollout_params
  devices = jax.devices()
  for dtype, copied in (("bfloat16", True), ("float32", False)):
    cfg = plan.load_recipe(str(CONFIGS / "grpo_tiny.yaml"), [f"model.overrides.dtype={dtype}"])
    mc = model_config(cfg, attention="reference", layers=None)
    ctx = build_context(cfg, devices, mc)
    read, master = rollout_params(ctx)
    full = device_bytes(ctx.params)
    if copied:
      assert {x.dtype for x in _floats(read)} == {jnp.dtype(jnp.bfloat16)} and device_bytes(master) == full
      assert device_bytes(read) == full // 2
    else:
      assert read is ctx.params and master == ()


def test_target_variants_apply_and_are_validated():
  """plan.overrides[target] is what `jaxrl plan --target` and `jaxrl rl --target` run; the command line's
  key=value still wins; a bad variant is refused at load naming the target and the key."""
  for recipe in REAL:
    base = plan.load_recipe(str(CONFIGS / f"{recipe}.yaml"))
    gpu = plan.load_recipe(str(CONFIGS / f"{recipe}.yaml"), target="h100x8")
    # one prompt per (rollout) GPU: 8, or 6 for the asynchronous recipe's 6 rollout GPUs
    assert "h100x8" in base.plan.overrides and gpu.rollout.engine.prefill_rows in (6, 8), recipe
    assert gpu.rollout.engine.kv_cache_bytes < base.rollout.engine.kv_cache_bytes, recipe
    tpu = base.plan.targets[0]
    if tpu not in base.plan.overrides:
      assert plan.load_recipe(str(CONFIGS / f"{recipe}.yaml"), target=tpu) == base  # no variant: unchanged
  # AReaL's v5p-8 variant: its one trainer chip trains one 32,768-token row per micro-batch
  areal = str(CONFIGS / "areal_1p5b.yaml")
  assert plan.load_recipe(areal).micro_batch.token_budget == 262144
  assert plan.load_recipe(areal, target="v5p-8").micro_batch.token_budget == 32768
  dapo = str(CONFIGS / "dapo_qwen2p5_7b.yaml")
  assert plan.load_recipe(dapo, target="h100x8").micro_batch.token_budget == 360448
  assert plan.load_recipe(dapo, ["micro_batch.token_budget=180224"], target="h100x8").micro_batch.token_budget == 180224
  with pytest.raises(config_lib.ConfigError, match=r"plan.overrides.h100x8: .*micro_batch.bogus"):
    plan.load_recipe(dapo, ["plan.overrides={h100x8: {micro_batch.bogus: 1}}"])
  with pytest.raises(config_lib.ConfigError, match=r"plan.overrides: unknown target 'h100x9'"):
    plan.load_recipe(dapo, ["plan.overrides={h100x9: {micro_batch.token_budget: 1}}"])
  with pytest.raises(config_lib.ConfigError, match=r"plan.overrides.h100x8: .*token_budget=100 is below"):
    plan.load_recipe(dapo, ["plan.overrides={h100x8: {micro_batch.token_budget: 100}}"])
  with pytest.raises(ValueError, match="--target: unknown 'tpu9'"):
    plan.load_recipe(dapo).plan.for_target("tpu9")
