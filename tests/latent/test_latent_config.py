"""Stage schedules of each method and config validation (no compilation)."""

import pathlib

import pytest

from jaxrl import config as config_lib
from jaxrl import latent

RECIPE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "coconut_tiny.yaml"


@pytest.mark.parametrize("method,want", [
    ("coconut", [(0, 10), (1, 10), (2, 20)]),
    ("no_thought", [(0, 10), (1, 10), (2, 20)]),
    ("pause_as_thought", [(0, 10), (1, 10), (2, 20)]),
    ("no_curriculum", [(2, 40)]),
    ("cot", [(0, 40)]),
    ("no_cot", [(3, 40)]),  # every step of the longest chain (3) removed
])
def test_stage_schedule(method, want):
  cfg = latent.CoconutConfig(method=method, max_stage=2, stage_steps=10, steps=40)
  assert latent.stage_schedule(cfg, max_steps_in_data=3) == want
  assert cfg.eval_thoughts == (2 if method in ("coconut", "no_curriculum", "pause_as_thought") else 0)


def test_config_errors_name_the_key(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="method"):
    config_lib.load(latent.CoconutConfig, None, ["method=iCoT"])
  with pytest.raises(ValueError, match="steps=20 must exceed max_stage × stage_steps = 20"):
    latent.CoconutConfig(max_stage=2, stage_steps=10, steps=20)


def test_recipe_loads():
  cfg = config_lib.load(latent.CoconutConfig, RECIPE, ["method=pause_as_thought"])
  assert cfg.method == "pause_as_thought" and cfg.c == 1 and cfg.max_stage == 2
