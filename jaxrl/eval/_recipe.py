"""A recipe's ``eval.benchmarks``: what ``jaxrl eval --config RECIPE`` takes from the recipe file (model,
tokenizer, compute dtype, mesh, engine settings, reward) and each benchmark's sampling and scoring settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl import config as config_lib
from jaxrl import rewards
from jaxrl.config import Benchmark, ConfigError
from jaxrl.eval._run import EvalSettings

ENGINE_DEFAULTS = {"num_slots": 32, "block_size": 16, "kv_cache_bytes": None}
"""Engine settings of a recipe without ``rollout.engine`` (SFT, DPO, latent): ``jaxrl eval``'s defaults."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeEval:
  """What a recipe file says about evaluating its model (:func:`read_recipe`)."""

  path: str
  "The recipe file."
  model: str | None
  "``model.hf_dir`` (``None``: a preset, random weights; ``--model`` must name a checkpoint)."
  tokenizer: str | None
  "``tokenizer``, else ``model.hf_dir``."
  dtype: str | None
  "``model.overrides.dtype`` (the compute dtype)."
  mesh: dict[str, int] | None
  "``mesh.shape`` (``None``: one device)."
  engine: dict[str, Any]
  "``num_slots``, ``block_size``, ``kv_cache_bytes`` of ``rollout.engine`` (else :data:`ENGINE_DEFAULTS`)."
  images: dict[str, Any] | None
  "``data.images`` (a VLM's image processing; ``None``: :class:`jaxrl.data.ImageConfig` defaults)."
  reward: dict[str, Any] | None
  "``reward.fn``, ``reward.kwargs``, ``reward.runner``, ``reward.correct_threshold`` (``None``: no reward section)."
  benchmarks: tuple[Benchmark, ...]
  "``eval.benchmarks``."


def _section(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
  value = data.get(key) or {}
  if not isinstance(value, dict):
    raise ConfigError(f"{where}: {key}: expected a mapping, got {value!r}")
  return value


def read_recipe(path: str | Path, overrides: Sequence[str] = ()) -> RecipeEval:
  """Reads a recipe YAML (plus ``key=value`` overrides, as the trainers take them) for ``jaxrl eval --config``;
  errors name the file and the key (``eval.benchmarks[1].metrics``)."""
  where = str(path)
  data = config_lib.apply_overrides(config_lib.read_yaml(path), list(overrides))
  benchmarks = config_lib.read_benchmarks(data, where=where)
  model = _section(data, "model", where)
  engine = _section(_section(data, "rollout", where), "engine", where)
  reward = _section(data, "reward", where) if "reward" in data else None
  mesh = _section(data, "mesh", where).get("shape")
  recipe = RecipeEval(
      path=where, model=model.get("hf_dir"), tokenizer=data.get("tokenizer") or model.get("hf_dir"),
      dtype=(model.get("overrides") or {}).get("dtype"), mesh=dict(mesh) if mesh else None,
      images=_section(data, "data", where).get("images"),
      engine={k: engine.get(k, v) for k, v in ENGINE_DEFAULTS.items()},
      reward=None if reward is None else {"fn": reward.get("fn", "math"), "kwargs": reward.get("kwargs") or {},
                                          "runner": reward.get("runner") or {},
                                          "correct_threshold": reward.get("correct_threshold", 0.5)},
      benchmarks=benchmarks)
  for i, b in enumerate(benchmarks):
    try:
      rewards.parse_metrics(b.metrics or rewards.DEFAULT_METRICS, b.n)
    except ValueError as e:
      raise ConfigError(f"{where}: eval.benchmarks[{i}].metrics: {e}") from None
    if b.task == "recipe" and recipe.reward is None:
      raise ConfigError(f"{where}: eval.benchmarks[{i}].task: 'recipe' scores with the recipe's reward section, "
                        f"and this recipe has none (use math, code or custom)")
  return recipe


def select_benchmarks(recipe: RecipeEval, names: Sequence[str] = ()) -> list[Benchmark]:
  """The benchmarks called ``names`` (all of them when empty), in the recipe's order; an unknown name or a
  recipe without benchmarks raises :class:`jaxrl.config.ConfigError` listing what there is."""
  known = [b.name for b in recipe.benchmarks]
  if not known:
    raise ConfigError(f"{recipe.path}: no eval.benchmarks section (docs/eval.md, 'Recipes')")
  bad = [n for n in names if n not in known]
  if bad:
    raise ConfigError(f"{recipe.path}: no benchmark {bad[0]!r} in eval.benchmarks; known: {known}")
  return [b for b in recipe.benchmarks if not names or b.name in names]


def threshold_of(benchmark: Benchmark, recipe: RecipeEval) -> float:
  """The correctness threshold: the benchmark's, else the recipe's ``reward.correct_threshold``, else 0.5."""
  if benchmark.correct_threshold is not None:
    return benchmark.correct_threshold
  return float(recipe.reward["correct_threshold"]) if recipe.reward else 0.5


def benchmark_settings(benchmark: Benchmark, recipe: RecipeEval) -> EvalSettings:
  """The sampling and scoring settings of ``benchmark`` as :class:`jaxrl.eval.EvalSettings`."""
  return EvalSettings(n=benchmark.n, max_new_tokens=benchmark.max_new_tokens,
                      max_prompt_tokens=benchmark.max_prompt_tokens, temperature=benchmark.temperature,
                      top_p=benchmark.top_p, top_k=benchmark.top_k, seed=benchmark.seed,
                      stop_strings=tuple(benchmark.stop), correct_threshold=threshold_of(benchmark, recipe))


def benchmark_options(benchmark: Benchmark, recipe: RecipeEval) -> dict[str, Any]:
  """``jaxrl eval``'s options (argparse destinations) that ``benchmark`` and its recipe set; flags given on the
  command line override them. ``task: recipe`` becomes ``custom`` with the recipe's reward and its kwargs."""
  task, reward, kwargs, runner = benchmark.task, benchmark.reward, benchmark.reward_kwargs, None
  if task == "recipe":
    task, reward = "custom", recipe.reward["fn"]
    kwargs, runner = recipe.reward["kwargs"], recipe.reward["runner"]
  mesh = None if not recipe.mesh else ",".join(f"{k}={v}" for k, v in recipe.mesh.items())
  return {
      "model": recipe.model, "images": recipe.images, "tokenizer": recipe.tokenizer, "dtype": recipe.dtype, "mesh": mesh,
      "data": benchmark.data, "task": task, "reward": reward, "reward_kwargs": kwargs, "reward_runner": runner,
      "require_think": benchmark.require_think, "prompt_field": benchmark.prompt_field,
      "answer_field": benchmark.answer_field, "template": benchmark.template, "n": benchmark.n,
      "metrics": benchmark.metrics or rewards.DEFAULT_METRICS, "temperature": benchmark.temperature,
      "top_p": benchmark.top_p, "top_k": benchmark.top_k, "max_new_tokens": benchmark.max_new_tokens,
      "max_prompt_tokens": benchmark.max_prompt_tokens, "stop": list(benchmark.stop), "seed": benchmark.seed,
      "correct_threshold": threshold_of(benchmark, recipe), **recipe.engine}
