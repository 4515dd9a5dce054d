"""``jaxrl plan``: the byte accounting, an oversized recipe refused, and every real recipe fitting its target.

TPU targets need libtpu (``pip install 'jaxrl[plan]'``, installed by scripts/run.sh); without it the
TPU tests skip and say why. Compiles use ``layers=1`` (1 and 2 scanned layers, extrapolated to the
model's depth) and only the train step, the largest trainer program. One recipe compiles by default;
``JAXRL_PLAN_ALL=1`` compiles all four (each compile of a real-shape train step takes minutes of CPU).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import pytest

from jaxrl import plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = ["deepscaler_1p5b", "areal_1p5b", "dapo_qwen2p5_7b", "deepcoder_14b_grpo_plus"]


def _need(target: str):
  try:
    plan.get_target(target).compile_devices()
  except plan.TargetUnavailable as e:
    pytest.skip(f"compile-only devices unavailable: {e}")


def test_collective_bytes_parses_hlo_results():
  hlo = "\n".join([
      "  %all-reduce.1 = bf16[8,128]{1,0} all-reduce(bf16[8,128]{1,0} %x), replica_groups={{0,1}}",
      "  %ag = (f32[4,16]{1,0}, s32[2]{0}) all-gather-start(f32[1,16]{1,0} %y), dimensions={0}",
      "  %rs = f32[2,16]{1,0} reduce-scatter(f32[4,16]{1,0} %z), dimensions={0}",
      "  %add = f32[2,16]{1,0} add(f32[2,16]{1,0} %a, f32[2,16]{1,0} %b)",
  ])
  assert plan.collective_bytes(hlo) == {"all-reduce": 8 * 128 * 2, "all-gather": 4 * 16 * 4 + 2 * 4,
                                        "reduce-scatter": 2 * 16 * 4}


def test_accounting_matches_memory_analysis_on_cpu():
  """The shape-derived split (params, optimizer state, KV cache, batch) of every program's inputs adds up
  to the compiler's own argument bytes, and the peak is memory_analysis()'s sum."""
  cfg = plan.load_recipe(str(CONFIGS / "grpo_tiny.yaml"), ["micro_batch.token_budget=768"])
  result = plan.plan_recipe(cfg, "cpu", attention="reference")
  names = [r.program for r in result.rows]
  assert any(n.startswith("train_step") for n in names) and any(n.startswith("logprobs_ref") for n in names)
  assert any(n.startswith("sampler_decode") for n in names), names
  for r in result.rows:
    assert r.status == "ok", (r.program, r.error)
    inputs = r.params + r.opt_state + r.kv_cache + r.batch
    # jit drops inputs a program never reads (batch fields another objective uses; the prefill never
    # touches the unembedding): the compiler's argument bytes are the shape-derived total less those.
    assert r.arguments <= inputs, r
    if r.program.startswith(("train_step", "logprobs")):  # every weight and moment is read
      assert r.params + r.opt_state <= r.arguments, r
    else:
      unembed = cfg.model.config().vocab_size * cfg.model.config().hidden_size * 4
      assert inputs - r.arguments <= unembed + r.batch, r
    assert r.peak == max(r.arguments, inputs) + r.outputs - r.aliased + r.temporaries + r.code
  train = next(r for r in result.rows if r.program.startswith("train_step"))
  # float32 weights, replicated over the (data=8) mesh: every device holds all of them.
  assert train.params == cfg.model.config().num_params() * 4
  assert train.opt_state >= 2 * train.params  # Adam's two moments


def test_oversized_recipe_fails_naming_program_and_allocation(capsys, tmp_path):
  _need("v5e-8")
  out = tmp_path / "plan.json"
  rc = plan.main(["--config", str(CONFIGS / "deepcoder_14b_grpo_plus.yaml"), "--target", "v5e-8", "--layers", "1",
                  "--programs", "train", "--stages", "1", "--json", str(out)])
  err = capsys.readouterr().err
  assert rc == 1
  assert "train_step[s1]" in err and "largest allocation: optimizer state" in err and "Change:" in err, err
  rows = json.loads(out.read_text())[0]["rows"]
  assert rows[0]["status"] == "oom" and rows[0]["peak"] > rows[0]["hbm"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_train_step_fits_its_tpu_target(recipe):
  if recipe != RECIPES[0] and not os.environ.get("JAXRL_PLAN_ALL"):
    pytest.skip(f"{recipe}: set JAXRL_PLAN_ALL=1 to compile it (a real-shape TPU train step takes minutes of CPU "
                "per compile; docs/scaling.md has its table)")
  cfg = plan.load_recipe(str(CONFIGS / f"{recipe}.yaml"))
  tpu = [t for t in cfg.plan.targets if plan.get_target(t).platform == "tpu"]
  assert tpu, f"{recipe}: plan.targets names no TPU target"
  _need(tpu[0])
  last = len(cfg.rollout.context_schedule)
  # conftest sets "highest" matmul precision for CPU parity tests; a user's run (and the CLI) has the
  # default, and Mosaic refuses fp32-precision dots on bf16 operands inside the Pallas kernel.
  with jax.default_matmul_precision("default"):
    result = plan.plan_recipe(cfg, tpu[0], layers=1, programs=("train",), stages=(last,))
  assert result.attention == "pallas_tpu"
  assert result.rows, recipe
  for r in result.rows:
    assert r.status == "ok", plan.advice(r, result)
    assert r.headroom >= 0.10, plan.format_plan(result)
