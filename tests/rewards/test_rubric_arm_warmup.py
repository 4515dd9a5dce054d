"""Rubric-ARM's Stage I: an SFT warm-up of a role from a JSONL (the repo's SFT trainer), whose export is where
that role's RL starts; a finished warm-up is reused by a rerun."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import models
from jaxrl.rl import RubricARM, RubricARMConfig

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rubric_arm_tiny.yaml"
SMALL = ("{vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 4, num_kv_heads: 2, "
         "head_dim: 8, dtype: float32, param_dtype: float32}")


def _leaves(tree):
  return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.slow
def test_sft_warm_up_is_where_the_judge_starts(tmp_path):
  sft_file = tmp_path / "judge_sft.jsonl"
  sft_file.write_text("".join(json.dumps({"prompt": f"r|{a}+1=?|{a + 1}|{a + 2}", "completion": "right [[A]]"}) + "\n"
                              for a in range(8)))
  overrides = [
      "pairs.builtin.n_train=8", f"generator.model.overrides={SMALL}", f"judge.model.overrides={SMALL}",
      f"judge_sft={{data: {{train: [{sft_file}]}}, steps: 2, packing: {{seq_len: 64, global_rows: 8}}, "
      "optim: {lr: 1.0e-2, warmup_steps: 0, schedule: constant}, eval: {every: 0}, checkpoint: {every: 0}}",
      f"out_dir={tmp_path / 'arm'}", "tensorboard=false"]
  cfg = config_lib.load(RubricARMConfig, CONFIG, overrides)
  arm = RubricARM(cfg)
  try:
    hf = tmp_path / "arm" / "sft" / "judge" / "hf"
    assert arm.judge.cfg.model.hf_dir == str(hf) and arm.generator.cfg.model.preset == "tiny"
    assert arm.warmup["judge"]["steps"] == 2 and "generator" not in arm.warmup
    exported = _leaves(nnx.state(models.load_pretrained(hf, dtype="float32")))
    started = _leaves(arm.judge.state.params)
    assert len(exported) == len(started) and all(np.array_equal(a, b) for a, b in zip(exported, started))
    fresh = _leaves(nnx.state(cfg.judge.model.build()))  # the untrained seed-2 init
    assert not all(np.array_equal(a, b) for a, b in zip(fresh, started)), "the warm-up did not train"
    stamp = (hf / "model.safetensors").stat().st_mtime_ns
    source = arm._warm_up("judge", cfg.judge_sft, cfg.judge)  # a rerun reuses the finished warm-up
    assert source.hf_dir == str(hf) and (hf / "model.safetensors").stat().st_mtime_ns == stamp
    assert arm.warmup["judge"]["steps"] == 2
  finally:
    arm.close()
