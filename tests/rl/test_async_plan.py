"""``jaxrl plan`` on an ``asynchronous:`` recipe: the rollout sub-mesh runs the engine's programs with only
compute-dtype weights and its pool, the trainer sub-mesh the update and log-prob programs with the master
weights and optimizer state; each is compiled on its own devices and checked against the memory per device."""

from pathlib import Path

import pytest

from jaxrl import plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# areal_async_tiny with one layer, bfloat16 compute (so the rollout's copy differs from the float32 master
# weights) and small micro-batches: cheap to compile on the 8 CPU devices (6 rollout + 2 trainer).
OVER = ["model.overrides.num_layers=1", "model.overrides.dtype=bfloat16", "micro_batch.token_budget=768"]


def test_async_recipe_plans_both_sub_meshes_on_their_own_devices():
  cfg = plan.load_recipe(str(CONFIGS / "areal_async_tiny.yaml"), OVER)
  result = plan.plan_recipe(cfg, "cpu", attention="reference")
  rows = {r.program: r for r in result.rows}
  assert set(rows) == {"rollout/engine_prefill[s0]", "rollout/engine_recompute[s0]", "rollout/engine_decode[s0]",
                       "trainer/train_step[s0]", "trainer/logprobs_old[s0]", "trainer/logprobs_ref[s0]"}, rows
  assert result.mesh == {"rollout.data": 6, "trainer.data": 2}
  for r in result.rows:
    assert r.status == "ok" and 0 < r.peak <= r.hbm, plan.advice(r, result)
  n = cfg.model.config().num_params()
  for name, r in rows.items():
    if name.startswith("rollout/"):  # bfloat16 copy, replicated over data=6; no optimizer state, no master copy
      assert (r.params, r.opt_state) == (2 * n, 0), (name, r.params, r.opt_state)
    elif name.startswith("trainer/train_step"):
      assert r.params == 4 * n and r.opt_state >= 2 * r.params
  assert rows["rollout/engine_decode[s0]"].kv_cache == cfg.rollout.engine.kv_cache_bytes
  assert any("rollout sub-mesh" in line and "x 6 shards" in line for line in result.engine), result.engine
  assert any(line.startswith("asynchronous trainer sub-mesh: 2 of 8 devices") for line in result.engine)
  assert "rollout/engine_decode[s0]" in plan.format_plan(result)


def test_async_plan_refuses_a_rollout_mesh_that_does_not_fit_its_devices():
  cfg = plan.load_recipe(str(CONFIGS / "areal_async_tiny.yaml"), OVER + ["asynchronous.rollout_mesh={data: 4}"])
  with pytest.raises(ValueError, match=r"asynchronous.rollout_mesh on the 6 rollout devices of cpu"):
    plan.plan_recipe(cfg, "cpu", attention="reference")


def test_async_context_schedule_plans_one_engine_for_the_largest_stage():
  """The asynchronous engine is built once for every stage (admission runs ahead into later ones): one budget, the
  largest stage's ``max_len`` (prompt 32 + 64); the synchronous recipe plans one engine per stage."""
  import jax

  from jaxrl import sharding
  schedule = ["rollout.context_schedule=[{start_step: 50, max_new_tokens: 64, n: 4}]"]
  cfg = plan.load_recipe(str(CONFIGS / "areal_async_tiny.yaml"), OVER + schedule)
  mesh = sharding.MeshConfig(shape={"data": -1}).build(jax.devices()[:6])
  got = [(tag, b.max_len) for tag, b in plan.recipe_budgets(cfg, cfg.model.config(), mesh)]
  assert got == [("s0,s1", 96)]
  sync = plan.load_recipe(str(CONFIGS / "areal_async_tiny.yaml"), OVER + schedule + ["asynchronous=null"])
  assert [b.max_len for _, b in plan.recipe_budgets(sync, sync.model.config(), mesh)] == [64, 96]
