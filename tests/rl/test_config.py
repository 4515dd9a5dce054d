"""The five RL configs load through RLConfig, and `jaxrl info` builds their mesh and model without weights."""

import dataclasses
import json
from pathlib import Path

import pytest

from jaxrl import config as config_lib
from jaxrl import info, models, quickstart, rl
from jaxrl.cli.rl import main as main_rl

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = {
    "deepscaler_1p5b": "deepseek_r1_distill_qwen_1p5b",
    "deepcoder_14b_grpo_plus": "deepseek_r1_distill_qwen_14b",
    "dapo_qwen2p5_7b": "qwen2p5_7b",
    "areal_1p5b": "deepseek_r1_distill_qwen_1p5b",
}


@pytest.mark.parametrize("name", ["grpo_tiny", *RECIPES])
def test_config_loads_and_validates(name):
  cfg = config_lib.load(rl.RLConfig, CONFIGS / f"{name}.yaml")
  assert cfg.row_len <= cfg.micro_batch.token_budget
  assert cfg.row_len >= cfg.data.max_prompt_tokens + cfg.rollout.max_max_new_tokens - 1


@pytest.mark.parametrize("name", list(RECIPES))
def test_info_builds_mesh_and_model_without_weights(name, tmp_path):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  preset = models.PRESETS[RECIPES[name]]()
  (hf_dir / "config.json").write_text(json.dumps(preset.to_hf_config()))
  text = info.describe(str(CONFIGS / f"{name}.yaml"), [f"model.hf_dir={hf_dir}"])
  assert "mesh: data=1" in text
  assert f"layers={preset.num_layers} d={preset.hidden_size}" in text


def test_recipe_features():
  load = lambda name: config_lib.load(rl.RLConfig, CONFIGS / f"{name}.yaml")
  coder = load("deepcoder_14b_grpo_plus")
  assert coder.algorithm.kl_coef == 0 and coder.algorithm.entropy_coef == 0
  assert coder.rollout.overlong_filter and coder.algorithm.objective_kwargs["epsilon_high"] == 0.28
  dapo = load("dapo_qwen2p5_7b")
  assert dapo.rollout.dynamic_sampling and dapo.rollout.overlong_penalty.cache_len == 4096
  areal = load("areal_1p5b")
  assert areal.algorithm.decoupled and areal.algorithm.advantage == "global_normalize"
  assert areal.reward.kwargs["config"]["correct_value"] == 5.0
  deepscaler = load("deepscaler_1p5b")
  assert [deepscaler.rollout.stage(s)[1] for s in (1, 1039, 1040, 1520, 1750)] == [8192, 8192, 16384, 24576, 24576]


def test_grpo_tiny_is_the_quickstart_rl_half():
  from_file = config_lib.load(rl.RLConfig, CONFIGS / "grpo_tiny.yaml")
  embedded = config_lib.from_dict(rl.RLConfig, dict(quickstart.RL, model=quickstart.TINY_MODEL,
                                                    out_dir=from_file.out_dir))
  assert from_file == embedded


@pytest.mark.parametrize("override, message", [
    ("algorithm.objective=ppo_clipp", "algorithm.objective: unknown 'ppo_clipp'"),
    ("algorithm.aggregation=mean", "algorithm.aggregation: unknown 'mean'"),
    ("algorithm.mini_batches=3", "algorithm.mini_batches=3 must divide rollout.prompts_per_step=16"),
    ("rollout.temperature=0", "rollout.temperature must be > 0"),
    ("micro_batch.row_len=40", "micro_batch.row_len=40 cannot hold a full sequence"),
    ("rollout.bogus=1", "unknown config key 'rollout.bogus'"),
    ("rollout.engine.prefill_chunk=24", "rollout.engine.prefill_chunk must be a positive multiple of block_size=16"),
])
def test_bad_values_name_the_key(override, message):
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
    config_lib.load(rl.RLConfig, CONFIGS / "grpo_tiny.yaml", [override])


def test_main_rl_reports_config_errors(capsys):
  assert main_rl(["--config", str(CONFIGS / "grpo_tiny.yaml"), "rollout.n=0"]) == 2
  assert "rollout.n must be >= 1, got 0" in capsys.readouterr().err
