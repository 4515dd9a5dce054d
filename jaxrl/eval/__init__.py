"""Evaluation as papers report it: ``n`` samples per problem, scored by a reward, reported as avg@k, unbiased
pass@k and maj@k (``jaxrl eval``; ``docs/eval.md``); rejection sampling of an SFT data set from the same
records (``jaxrl rs``); the vision-language RL data builders (``jaxrl caprl-curate``, ``jaxrl rubicap-rubrics``,
``jaxrl vision-r1-coldstart``) over the reward layer's answerer/judge clients.

Layer (docs/design.md): above ``rl`` beside ``plan``, ``serve`` and ``bench``; it uses the public APIs of
``rl`` (prompt records, the engine), ``envs`` (a record's prompt messages), ``rewards`` (scoring, answer
normalisation) and ``train`` (the progress logger).
The metric functions (:mod:`jaxrl.rewards`' avg@k, pass@k, maj@k) are pure (numpy and the answer
normalisation only) and shared with the RL trainers' held-out evaluation.
"""

from jaxrl.rewards import (  # the metrics live with the rewards: the RL trainer's evaluation reports them too
  DEFAULT_METRICS,
  avg_at_k,
  maj_at_k,
  majority_index,
  parse_metrics,
  pass_at_k,
  problem_metrics,
  summarize,
)
from jaxrl.eval._run import (
  RECORDS,
  SETTINGS,
  SUMMARY,
  TASKS,
  EvalSettings,
  evaluate,
  load_problems,
  make_sampler,
  make_scorer,
  markdown,
  part_name,
  problem_id,
  read_done,
  summary,
  write_summary,
)
from jaxrl.eval._recipe import (
  ENGINE_DEFAULTS,
  RecipeEval,
  benchmark_options,
  benchmark_settings,
  read_recipe,
  select_benchmarks,
  threshold_of,
)
from jaxrl.eval._caprl_curate import CurateConfig, curate_file, curate_questions
from jaxrl.eval._cold_start import ColdStartConfig, build_cold_start, cold_start_file
from jaxrl.eval._rubicap_synth import RUBRIC_WRITER_TEMPLATE, SynthConfig, synthesize_file, synthesize_rubrics
from jaxrl.eval._vlrl_io import image_part, read_image_records
from jaxrl.eval._rejection import (
  DATASET,
  STATS,
  STATS_MD,
  normalize_whitespace,
  rejection_sample,
  select_samples,
  sft_record,
  stats_markdown,
  write_dataset,
)

__all__ = [
  "ColdStartConfig",
  "CurateConfig",
  "RUBRIC_WRITER_TEMPLATE",
  "SynthConfig",
  "build_cold_start",
  "cold_start_file",
  "curate_file",
  "curate_questions",
  "image_part",
  "read_image_records",
  "synthesize_file",
  "synthesize_rubrics",
  "DATASET",
  "ENGINE_DEFAULTS",
  "RecipeEval",
  "benchmark_options",
  "benchmark_settings",
  "read_recipe",
  "select_benchmarks",
  "threshold_of",
  "DEFAULT_METRICS",
  "RECORDS",
  "SETTINGS",
  "STATS",
  "STATS_MD",
  "SUMMARY",
  "TASKS",
  "EvalSettings",
  "avg_at_k",
  "evaluate",
  "load_problems",
  "maj_at_k",
  "majority_index",
  "make_sampler",
  "make_scorer",
  "markdown",
  "normalize_whitespace",
  "parse_metrics",
  "pass_at_k",
  "problem_id",
  "problem_metrics",
  "part_name",
  "read_done",
  "rejection_sample",
  "select_samples",
  "sft_record",
  "stats_markdown",
  "summarize",
  "summary",
  "write_dataset",
  "write_summary",
]
