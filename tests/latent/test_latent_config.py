"""Stage schedules of each method and config validation (no compilation)."""

import pathlib

import pytest
from latent_testlib import tokenizer_and_tokens

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


def test_prosqa_recipe_loads():
  cfg = config_lib.load(latent.CoconutConfig, RECIPE.with_name("coconut_prosqa_tiny.yaml"),
                        ["eot_head=0.1", "eval.stop=classifier"])
  assert cfg.data.prosqa.max_hops == cfg.max_stage == 3 and cfg.pack_length == 1024 and cfg.eval.stop == "classifier"


@pytest.mark.parametrize("overrides,match", [
    (["eot_head=0.5", "method=cot"], "eot_head=0.5 needs continuous thoughts"),
    (["eval.stop=classifier"], "eval.stop=classifier needs the <eot> head"),
    (["eval.stop=sometimes"], "eval.stop"),
    (["eval.before=maybe"], "eval.before"),
    (["pack_length=-1"], "pack_length"),
    (["data.prosqa.min_hops=0"], "min_hops"),
])
def test_new_keys_are_validated(overrides, match):
  with pytest.raises((config_lib.ConfigError, ValueError), match=match):
    config_lib.load(latent.CoconutConfig, RECIPE, overrides)


def test_pack_length_too_small_names_the_key():
  tok, ids = tokenizer_and_tokens()
  examples = [latent.stage_example(latent.Chain("1+2=?", ("1+2=3",), "3"), 1, c=1, tokenizer=tok, tokens=ids)]
  with pytest.raises(ValueError, match="pack_length=16 cannot hold the longest example"):
    latent.PackedLayout.fit(examples, 16)
