"""Verifiable rewards: math, sandboxed code execution, format, combinations, reasoning-gym.

A reward function is ``fn(prompt, completion, **sample_fields) -> float | RewardResult``; load one
by import path with `load_reward` and score batches with `RewardRunner`. Nothing here needs JAX.
See ``docs/rewards.md``.
"""

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
from jaxrl.rewards._reasoning_gym import ReasoningGymRewardConfig, reasoning_gym_dataset, reasoning_gym_reward
from jaxrl.rewards._runner import RewardBatch, RewardBudgetExceeded, RewardError, RewardRunner, RewardRunnerConfig
from jaxrl.rewards._sandbox import (
  ExecResult,
  SandboxConfig,
  SandboxError,
  run_function_tests,
  run_program,
  sandbox_info,
)

__all__ = [
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
]
