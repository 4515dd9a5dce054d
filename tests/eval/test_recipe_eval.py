"""A recipe's ``eval.benchmarks``: every shipped recipe parses (and its trainer config still loads), mistakes name
the key, and ``jaxrl eval --config`` gives the records of the same settings spelled as flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from eval_testlib import read_jsonl

from jaxrl import config as config_lib
from jaxrl import eval as ev
from jaxrl.cli import eval as _cli
from jaxrl.config import ConfigError
from jaxrl.latent import CoconutConfig
from jaxrl.pref import DPOConfig
from jaxrl.rl import RLConfig
from jaxrl.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "hf" / "qwen3"
REAL = ["areal_1p5b", "caprl_3b", "dapo_qwen2p5_7b", "deepcoder_14b_grpo_plus", "deepscaler_1p5b",
        "rar_qwen2p5_7b", "rubicap_7b", "vision_r1_7b"]


def test_every_real_size_recipe_names_its_benchmarks():
  for name in REAL:
    recipe = ev.read_recipe(ROOT / "configs" / f"{name}.yaml")
    assert recipe.benchmarks, name
    cfg = config_lib.load(RLConfig, ROOT / "configs" / f"{name}.yaml")  # the trainer takes the section too
    assert cfg.eval.benchmarks == recipe.benchmarks
  deepscaler = ev.read_recipe(ROOT / "configs" / "deepscaler_1p5b.yaml")
  aime = ev.select_benchmarks(deepscaler, ["aime24"])[0]
  assert (aime.n, aime.max_new_tokens, aime.metrics.split(",")[0]) == (16, 32768, "avg@16")
  assert aime.template.endswith("within \\boxed{}.")  # the YAML escape is one backslash
  assert [b.name for b in deepscaler.benchmarks] == ["aime24", "math500", "amc23", "minerva", "olympiadbench"]
  assert {b.max_new_tokens for b in deepscaler.benchmarks} == {32768}  # the YAML merge keys carry the protocol
  lcb = ev.select_benchmarks(ev.read_recipe(ROOT / "configs" / "deepcoder_14b_grpo_plus.yaml"), ["lcb_64k"])[0]
  assert (lcb.task, lcb.n, lcb.max_prompt_tokens + lcb.max_new_tokens) == ("code", 16, 65536)


@pytest.mark.parametrize("cls, recipe", [(SFTConfig, "sft_tiny"), (DPOConfig, "dpo_tiny"),
                                         (CoconutConfig, "coconut_tiny")])
def test_every_trainer_takes_the_section(cls, recipe):
  bench = '{name: toy, data: x.jsonl, n: 2, metrics: "avg@2"}'
  cfg = config_lib.load(cls, ROOT / "configs" / f"{recipe}.yaml", [f"eval.benchmarks=[{bench}]"])
  assert cfg.eval.benchmarks == (config_lib.Benchmark(name="toy", data="x.jsonl", n=2, metrics="avg@2"),)


def _recipe(tmp_path, benchmarks, **extra):
  path = tmp_path / "recipe.yaml"
  data = {"model": {"hf_dir": str(MODEL)}, "eval": {"every": 0, "benchmarks": benchmarks}, **extra}
  path.write_text(yaml.safe_dump(data), encoding="utf-8")
  return path


@pytest.mark.parametrize("bench, message", [
    ({"name": "a", "data": "x.jsonl", "nn": 3}, "unknown config key 'eval.benchmarks[0].nn'"),
    ({"name": "a", "data": "x.jsonl", "n": "4"}, "eval.benchmarks[0].n: expected an int"),
    ({"name": "a", "data": "x.jsonl", "n": 4, "metrics": "avg@8"}, "eval.benchmarks[0].metrics"),
    ({"name": "a", "data": "x.jsonl", "task": "recipe"}, "eval.benchmarks[0].task: 'recipe'"),
    ({"name": "a", "data": "x.jsonl", "task": "custom"}, "eval.benchmarks[0]: reward"),
    ({"name": "a", "data": "x.jsonl", "reward_kwargs": {"x": 1}}, "eval.benchmarks[0]: reward_kwargs go with task custom"),
    ({"name": "a", "data": "x.jsonl", "task": "custom", "reward": "m:f", "reward_kwargs": 3},
     "eval.benchmarks[0].reward_kwargs"),
    ({"name": "a b", "data": "x.jsonl"}, "eval.benchmarks[0]: name must be"),
    ({"name": "a"}, "missing required config key 'eval.benchmarks[0].data'"),
])
def test_benchmark_mistakes_name_the_key(tmp_path, bench, message):
  with pytest.raises(ConfigError, match=r"recipe\.yaml: .*") as e:
    ev.read_recipe(_recipe(tmp_path, [bench]))
  assert message in str(e.value)


def test_unknown_benchmark_and_duplicates(tmp_path, capsys):
  path = _recipe(tmp_path, [{"name": "a", "data": "x.jsonl"}, {"name": "a", "data": "y.jsonl"}])
  with pytest.raises(ConfigError, match=r"names must be unique, \['a'\] repeat"):
    ev.read_recipe(path)
  path = _recipe(tmp_path, [{"name": "a", "data": "x.jsonl"}])
  assert _cli.main(["--config", str(path), "--benchmark", "b"]) == 2
  assert "no benchmark 'b' in eval.benchmarks; known: ['a']" in capsys.readouterr().err


def test_config_run_equals_the_flags_run(tmp_path, capsys):
  data = tmp_path / "math.jsonl"
  rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "id": f"p{i}"} for i in range(3)]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  bench = {"name": "toy", "data": str(data), "prompt_field": "problem", "n": 3, "metrics": "avg@3,pass@1,maj@3",
           "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 5, "max_prompt_tokens": 64, "seed": 7,
           "template": "{prompt} Put the answer in \\boxed{}."}
  engine = {"rollout": {"engine": {"num_slots": 6, "block_size": 8}}}
  path = _recipe(tmp_path, [bench, {**bench, "name": "other", "n": 2, "metrics": "avg@2"}], **engine)
  assert _cli.main(["--config", str(path), "--benchmark", "toy", "--out", str(tmp_path / "cfg")]) == 0
  flags = ["--model", str(MODEL), "--data", str(data), "--prompt-field", "problem", "--n", "3", "--metrics",
           "avg@3,pass@1,maj@3", "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", "5",
           "--max-prompt-tokens", "64", "--seed", "7", "--template", bench["template"], "--num-slots", "6",
           "--block-size", "8", "--out", str(tmp_path / "flags")]
  assert _cli.main(flags) == 0
  capsys.readouterr()
  by_config, by_flags = (read_jsonl(tmp_path / d / "toy" / ev.RECORDS) if d == "cfg" else
                         read_jsonl(tmp_path / d / ev.RECORDS) for d in ("cfg", "flags"))
  assert by_config == by_flags and len(by_config) == 3
  summaries = [json.loads((tmp_path / p / ev.SUMMARY).read_text()) for p in ("cfg/toy", "flags")]
  assert summaries[0]["metrics"] == summaries[1]["metrics"]
  assert summaries[0]["settings"] == summaries[1]["settings"]
  assert summaries[0]["benchmark"] == "toy" and not (tmp_path / "cfg" / "other").exists()
  # a flag given on the command line overrides the benchmark's value; the others stay the recipe's
  argv = ["--config", str(path), "--benchmark", "other", "--n", "1", "--metrics", "avg@1", "--stop", "\n"]
  (args, out), = _cli.recipe_runs(_cli.build_parser().parse_args(argv), _cli.explicit_options(argv))
  assert (args.n, args.metrics, args.stop, args.max_new_tokens, args.num_slots) == (1, "avg@1", ["\n"], 5, 6)
  assert out == Path("eval_out") / "recipe" / "other" and args.model == str(MODEL)


def test_a_custom_benchmarks_reward_kwargs_reach_the_scorer(tmp_path):
  bench = {"name": "c", "data": "x.jsonl", "task": "custom", "reward": "jaxrl.rewards:math_reward",
           "reward_kwargs": {"config": {"require_think": True}}}
  path = _recipe(tmp_path, [bench])
  (args, _), = _cli.recipe_runs(_cli.build_parser().parse_args(["--config", str(path)]), {})
  assert (args.task, args.reward, args.reward_kwargs) == ("custom", bench["reward"], bench["reward_kwargs"])
  plain = _recipe(tmp_path, [{k: v for k, v in bench.items() if k != "reward_kwargs"}])
  (args, _), = _cli.recipe_runs(_cli.build_parser().parse_args(["--config", str(plain)]), {})
  assert args.reward_kwargs is None
