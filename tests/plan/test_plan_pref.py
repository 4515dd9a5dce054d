"""``jaxrl plan`` on preference recipes (``jaxrl dpo``: the pair train step and the reference log-prob program) and
on a ``distill:`` section (the teacher's log-prob program).

The real-size recipe (configs/dpo_qwen2p5_7b.yaml) fits both of its targets from shapes here and compiles at full
depth for h100x8 (about 30 s of CPU); its v5p-8 compile (about 90 s) and all the numbers are in docs/scaling.md,
"Preference recipes".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl import models, plan, pref
from plan_testlib import need

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPE = str(CONFIGS / "dpo_qwen2p5_7b.yaml")



@pytest.mark.parametrize("lr_multipliers", [{}, {"layers/attn": 0.5, "embed": 2.0}])
def test_tiny_dpo_recipe_compiles_and_accounts_its_inputs(lr_multipliers):
  """configs/dpo_tiny.yaml on the CPU: both programs compile; the train step holds the float32 weights, Adam's
  two moments and the reference's copy (float32 here); the batch is the rows plus the per-pair arrays.
  ``optim.lr_multipliers`` adds no optimizer state."""
  cfg = plan.load_recipe(str(CONFIGS / "dpo_tiny.yaml"))
  cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr_multipliers=lr_multipliers))
  assert isinstance(cfg, pref.DPOConfig)
  result = plan.plan_recipe(cfg, "cpu", attention="reference")
  rows = {r.program: r for r in result.rows}
  assert set(rows) == {"train_step", "reference_logps"}
  n_params = cfg.model.config().num_params()
  step, ref = rows["train_step"], rows["reference_logps"]
  assert step.status == ref.status == "ok"
  assert step.params == pytest.approx(2 * 4 * n_params, rel=1e-3)  # policy + frozen copy, float32
  assert step.opt_state == pytest.approx(2 * 4 * n_params, rel=1e-3)  # Adam's m and v
  assert ref.params == pytest.approx(4 * n_params, rel=1e-3) and ref.opt_state == 0
  devices = len(plan.get_target("cpu").compile_devices())  # rows and pairs split over them (data parallel)
  rows_bytes = cfg.packing.global_rows * cfg.packing.seq_len * 4 * len(pref.PAIR_KEYS) // devices
  per_pair = 5 * cfg.pairs * 4 // devices  # chosen/rejected lengths, margins, desirable, pair_valid
  assert ref.batch == rows_bytes + per_pair, (ref.batch, rows_bytes, per_pair)
  assert step.peak >= step.params + step.opt_state


@pytest.mark.parametrize("target", ["v5p-8", "h100x8"])
def test_dpo_7b_recipe_fits_its_targets_from_shapes(target):
  """Inputs from shapes (float32 master weights and Adam moments, the bf16 reference copy, the batch) leave at
  least 10 % of HBM on every device: a lower bound of the compiled peak (compiled: docs/scaling.md)."""
  need(target)
  cfg = plan.load_recipe(RECIPE, target=target)
  assert target in plan.plan_targets(cfg)
  result = plan.plan_recipe(cfg, target, compile=False)
  n_params = models.ModelConfig.qwen2p5_7b().num_params()
  devices = len(plan.get_target(target).compile_devices())
  for r in result.rows:
    assert r.status == "ok" and r.headroom >= 0.10, plan.format_plan(result)
  step = next(r for r in result.rows if r.program == "train_step")
  np.testing.assert_allclose(step.params, (4 + 2) * n_params / devices, rtol=0.02)  # f32 policy + bf16 reference


def test_distill_teacher_logprob_program_is_planned_on_the_trainer_mesh():
  """configs/distill_tiny.yaml (reverse_kl): one ``logprobs_teacher`` row, compiled, whose params are the teacher's
  weights in its compute dtype (float32 here, replicated on the data-parallel CPU mesh), not the student's;
  under ``distill.mode=gkd`` (the teacher runs inside the train step) or with ``distill.server`` no such row."""
  cfg = plan.load_recipe(str(CONFIGS / "distill_tiny.yaml"))
  result = plan.plan_recipe(cfg, "cpu", attention="reference", programs=("teacher",))
  assert [r.program for r in result.rows] == ["logprobs_teacher[s0]"]
  row = result.rows[0]
  teacher, student = cfg.distill.teacher.config(), cfg.model.config()
  assert teacher.num_params() != student.num_params()
  assert row.status == "ok" and row.params == pytest.approx(4 * teacher.num_params(), rel=1e-3)
  gkd = plan.load_recipe(str(CONFIGS / "distill_tiny.yaml"), ["distill.mode=gkd"])
  assert plan.plan_recipe(gkd, "cpu", attention="reference", programs=("teacher",), compile=False).rows == []
  server = plan.load_recipe(str(CONFIGS / "distill_tiny.yaml"), [  # a teacher behind jaxrl serve: not on this mesh
      "distill.teacher=null", 'distill.server={"base_url": "http://127.0.0.1:8001/v1", "model": "teacher"}'])
  assert plan.plan_recipe(server, "cpu", attention="reference", programs=("teacher",), compile=False).rows == []



def test_dpo_7b_recipe_compiles_and_fits_h100x8():
  """The real-size recipe's two programs compiled at full depth (28 layers) for h100x8 (about 30 s of CPU; v5p-8's
  90 s compile is recorded in docs/scaling.md, "Preference recipes", and its inputs are checked from shapes above)
  fit with at least 10 % of HBM left, and each compiled peak holds at least the inputs counted from shapes."""
  target = "h100x8"
  need(target)
  cfg = plan.load_recipe(RECIPE, target=target)
  shapes = {r.program: r for r in plan.plan_recipe(cfg, target, compile=False).rows}
  result = plan.plan_recipe(cfg, target)
  assert result.compiled_layers == (28,), result.compiled_layers
  assert {r.program for r in result.rows} == {"train_step", "reference_logps"}
  for r in result.rows:
    assert r.status == "ok" and r.headroom >= 0.10, plan.format_plan(result)
    assert r.peak >= shapes[r.program].params + shapes[r.program].opt_state, (r, shapes[r.program])


@pytest.mark.parametrize("logprob_feature", [False, True])
def test_tiny_reward_model_recipe_compiles_and_accounts_its_inputs(logprob_feature):
  """configs/rm_tiny.yaml on the CPU: one train step (no reference), compiled; it holds the trunk without its
  unembedding plus the scalar head (with the log-prob feature: the whole model plus the head and α), and Adam's two
  moments of the same; its model FLOPs leave out the output projection only without the feature."""
  over = ["loss.pooling=mean", "loss.logprob_feature=true"] if logprob_feature else []
  cfg = plan.load_recipe(str(CONFIGS / "rm_tiny.yaml"), over)
  assert isinstance(cfg, pref.DPOConfig) and cfg.loss.reward_model
  result = plan.plan_recipe(cfg, "cpu", attention="reference")
  assert [r.program for r in result.rows] == ["train_step"]
  step = result.rows[0]
  assert step.status == "ok"
  mc = cfg.model.config()
  head = mc.hidden_size + 1 + (1 if logprob_feature else 0)
  n_params = mc.num_params() - (0 if logprob_feature else mc.vocab_size * mc.hidden_size) + head
  # float32, replicated on the data-parallel mesh (the unembedding alone is 4 % of it)
  assert step.params == pytest.approx(4 * n_params, rel=1e-4)
  assert step.opt_state == pytest.approx(2 * 4 * n_params, rel=1e-4)
  tokens = cfg.packing.global_rows * cfg.packing.seq_len
  unembed = 0 if logprob_feature else 6 * mc.vocab_size * mc.hidden_size * tokens
  assert step.model_flops == pytest.approx(mc.flops_per_token(cfg.packing.seq_len) * tokens - unembed,
                                                  rel=1e-6)


@pytest.mark.parametrize("target", ["v5p-8", "h100x8"])
@pytest.mark.parametrize("logprob_feature", [False, True])
def test_rm_7b_recipe_fits_its_targets_from_shapes(target, logprob_feature):
  """configs/rm_qwen2p5_7b.yaml (and its log-prob-feature variant) leaves at least 10 % of HBM on every device
  from shapes: float32 weights (without the unembedding unless the feature keeps it) and Adam's moments, sharded
  (compiled at full depth: docs/scaling.md, "Preference recipes")."""
  need(target)
  over = ["loss.pooling=mean", "loss.logprob_feature=true"] if logprob_feature else []
  cfg = plan.load_recipe(str(CONFIGS / "rm_qwen2p5_7b.yaml"), over, target=target)
  result = plan.plan_recipe(cfg, target, compile=False)
  mc = models.ModelConfig.qwen2p5_7b()
  n_params = mc.num_params() - (0 if logprob_feature else mc.vocab_size * mc.hidden_size)
  devices = len(plan.get_target(target).compile_devices())
  [step] = result.rows
  assert step.status == "ok" and step.headroom >= 0.10, plan.format_plan(result)
  np.testing.assert_allclose(step.params, 4 * n_params / devices, rtol=0.01)
  np.testing.assert_allclose(step.opt_state, 8 * n_params / devices, rtol=0.01)
