"""Rewards: math, sandboxed code execution, format, combinations, reasoning-gym, judges and rubrics.

A reward function is ``fn(prompt, completion, **sample_fields) -> float | RewardResult``; load one
by import path with `load_reward` and score batches with `RewardRunner`. Nothing here needs JAX.
See ``docs/rewards.md``.

Layer (docs/design.md): may import ``sampling`` and the layers below (it needs only ``config``); not ``train``
or anything above.
"""

from jaxrl.rewards._autorubric import (
  HashingEmbedder,
  RubricSelection,
  WordLlamaEmbedder,
  coding_rate,
  default_embedder,
  propose_evaluate_revise,
  rubric_metrics,
  select_rubric_texts,
  select_rubrics,
)
from jaxrl.rewards._base import RewardFn, RewardResult, RewardValueError, coerce_reward, load_reward
from jaxrl.rewards._code import (
  CodeRewardConfig,
  CodeRunResult,
  FunctionTest,
  StdioTest,
  code_reward,
  extract_code,
  outputs_match,
  parse_tests,
  run_tests,
  select_tests,
)
from jaxrl.rewards._combine import Gate, Hierarchical, WeightedSum, gate, hierarchical_reward, weighted_sum
from jaxrl.rewards._format import FormatCheck, FormatConfig, check_format, format_reward
from jaxrl.rewards._math import (
  MathRewardConfig,
  extract_answer,
  extract_boxed,
  is_equivalent,
  math_backends,
  math_reward,
  normalize_answer,
)
from jaxrl.rewards._math_parser import evaluate as evaluate_expression
from jaxrl.rewards._math_parser import parse as parse_expression
from jaxrl.rewards._judge import PROVIDERS, Judge, JudgeConfig, ProviderProfile, close_judges, get_judge
from jaxrl.rewards._judge_launch import JudgeLaunch
from jaxrl.rewards._judge_parse import (
  JudgeError,
  JudgeResponse,
  JudgeScoreError,
  expected_score,
  parse_choice,
  parse_score,
)
from jaxrl.rewards._reasoning_gym import ReasoningGymRewardConfig, reasoning_gym_dataset, reasoning_gym_reward
from jaxrl.rewards._rubric import (
  CATEGORY_WEIGHTS,
  alignxplore_gen_reward,
  alignxplore_jud_reward,
  alignxplore_r_gen,
  alignxplore_r_jud,
  anchor_aggregate,
  explicit_rubric_score,
  judge_reward,
  pairwise_judge_reward,
  rubric_anchor_reward,
  rubric_reward,
)
from jaxrl.rewards._rubric_arm import (
  RUBRIC_ARM_JUDGE_TEMPLATE,
  judge_format_ok,
  rubric_arm_judge_prompts,
  rubric_arm_generator_reward,
  rubric_arm_judge_reward,
  rubric_arm_judge_value,
)
from jaxrl.rewards._runner import (
    RewardBatch,
    RewardBudgetExceeded,
    RewardError,
    RewardRunner,
    RewardRunnerConfig,
    RewardWorkersDied,
)
from jaxrl.rewards._sandbox import (
  ExecResult,
  SandboxConfig,
  SandboxError,
  run_function_tests,
  run_program,
  sandbox_info,
)

__all__ = [
  "HashingEmbedder",
  "RubricSelection",
  "WordLlamaEmbedder",
  "default_embedder",
  "select_rubric_texts",
  "coding_rate",
  "propose_evaluate_revise",
  "rubric_metrics",
  "select_rubrics",
  "CATEGORY_WEIGHTS",
  "PROVIDERS",
  "Judge",
  "JudgeConfig",
  "JudgeError",
  "JudgeLaunch",
  "JudgeResponse",
  "JudgeScoreError",
  "ProviderProfile",
  "RUBRIC_ARM_JUDGE_TEMPLATE",
  "alignxplore_gen_reward",
  "alignxplore_jud_reward",
  "alignxplore_r_gen",
  "alignxplore_r_jud",
  "anchor_aggregate",
  "close_judges",
  "explicit_rubric_score",
  "expected_score",
  "get_judge",
  "judge_format_ok",
  "judge_reward",
  "pairwise_judge_reward",
  "parse_choice",
  "parse_score",
  "rubric_anchor_reward",
  "rubric_arm_generator_reward",
  "rubric_arm_judge_reward",
  "rubric_arm_judge_value",
  "rubric_reward",
  "CodeRewardConfig",
  "CodeRunResult",
  "ExecResult",
  "FormatCheck",
  "FormatConfig",
  "FunctionTest",
  "Gate",
  "Hierarchical",
  "MathRewardConfig",
  "ReasoningGymRewardConfig",
  "RewardBatch",
  "RewardBudgetExceeded",
  "RewardWorkersDied",
  "RewardError",
  "RewardFn",
  "RewardResult",
  "RewardRunner",
  "RewardRunnerConfig",
  "RewardValueError",
  "SandboxConfig",
  "SandboxError",
  "StdioTest",
  "WeightedSum",
  "check_format",
  "code_reward",
  "coerce_reward",
  "extract_answer",
  "extract_boxed",
  "extract_code",
  "format_reward",
  "gate",
  "hierarchical_reward",
  "is_equivalent",
  "load_reward",
  "math_backends",
  "math_reward",
  "normalize_answer",
  "outputs_match",
  "parse_tests",
  "reasoning_gym_dataset",
  "reasoning_gym_reward",
  "run_function_tests",
  "run_program",
  "run_tests",
  "sandbox_info",
  "select_tests",
  "weighted_sum",
  "rubric_arm_judge_prompts",
  "evaluate_expression",
  "parse_expression",
]
