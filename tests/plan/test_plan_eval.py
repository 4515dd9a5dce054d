"""``jaxrl plan --programs eval``: the engine ``jaxrl eval --config RECIPE`` builds for each of the recipe's
``eval.benchmarks``, compiled on CPU, against a real engine built by ``jaxrl eval``'s own ``make_sampler``
and a hand count of its pool; the default program set leaves the group out."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxrl import eval as eval_lib
from jaxrl import models, plan, sharding

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BENCHMARKS = ("eval.benchmarks=[{name: a, data: a.jsonl, max_prompt_tokens: 32, max_new_tokens: 32}, "
              "{name: b, data: b.jsonl, max_prompt_tokens: 32, max_new_tokens: 32}, "
              "{name: c, data: c.jsonl, max_prompt_tokens: 16, max_new_tokens: 80}]")
# bfloat16 compute over float32 master weights; no kv_cache_bytes: jaxrl eval sizes its pool by the formula
TINY = ["model.overrides.dtype=bfloat16", "micro_batch.token_budget=768", "rollout.engine.kv_cache_bytes=null",
        "rollout.engine.kv_cache_fraction=0.5", BENCHMARKS]


@pytest.fixture(scope="module")
def planned():
  cfg = plan.load_recipe(str(CONFIGS / "grpo_tiny.yaml"), TINY)
  return cfg, plan.plan_recipe(cfg, "cpu", attention="reference", programs=("eval",))


def test_eval_rows_one_per_benchmark_shape_with_compute_dtype_weights_only(planned):
  cfg, result = planned
  names = [r.program for r in result.rows]
  assert names == ["eval_prefill[a,b]", "eval_recompute[a,b]", "eval_decode[a,b]",
                   "eval_prefill[c]", "eval_recompute[c]", "eval_decode[c]"], names
  assert all(r.status == "ok" for r in result.rows), [(r.program, r.status, r.error) for r in result.rows]
  mc = cfg.model.config()
  assert mc.dtype == "bfloat16" and mc.param_dtype == "float32"
  for r in result.rows:  # replicated bfloat16 weights on every device, no master copy, no optimizer state
    assert r.params == mc.num_params() * 2 and r.opt_state == 0, (r.program, r.params, r.opt_state)


def test_eval_pool_equals_what_jaxrl_eval_allocates(planned):
  """No ``kv_cache_bytes``: ``num_slots * (ceil(max_len / 16) + 1)`` blocks; a block holds k and v of 2 layers
  x 16 tokens x 2 kv heads x 16 dims in bfloat16 (4 KiB), the pool's blocks split over the 8 data shards."""
  cfg, result = planned
  mc = cfg.model.config()
  mesh = sharding.make_mesh(cfg.mesh.shape)
  rules = cfg.mesh.logical_rules()
  model = models.init_model(mc, mesh=mesh, rules=rules)
  shards = mesh.shape["data"]
  for tag, max_len in (("a,b", 64), ("c", 96)):
    blocks = 64 * (-(-max_len // 16) + 1)
    hand = blocks // shards * (2 * 2 * 16 * 2 * 16 * 2)
    eng = eval_lib.make_sampler(model, None, max_len=max_len, num_slots=64, block_size=16, mesh=mesh, rules=rules)
    assert eng.pages[0].dtype == jnp.bfloat16 and eng.num_blocks == blocks - blocks % shards
    assert eng.kv_cache_bytes_per_device == hand
    for r in result.rows:
      if r.program.endswith(f"[{tag}]"):
        assert r.kv_cache == hand, (r.program, r.kv_cache, hand)


def test_eval_group_is_opt_in_and_empty_without_benchmarks():
  assert "eval" in plan.PROGRAMS and "eval" not in plan.program_names(None)
  assert plan.program_names(None) == [n for n in plan.PROGRAMS if n != "eval"]
  assert plan.program_names(("eval",)) == ["eval"]
  cfg = plan.load_recipe(str(CONFIGS / "grpo_tiny.yaml"))
  assert not cfg.eval.benchmarks and not plan.eval_shapes(cfg)
  assert plan.eval_engine_config(cfg, 64).kv_cache_bytes == cfg.rollout.engine.kv_cache_bytes
