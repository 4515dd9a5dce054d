"""Code reward: run the completion's program against test cases in the sandbox.

DeepCoder's sparse outcome reward (seed 000, "奖励函数"): 1 only if the program passes *all*
sampled tests, where the sample is the 15 hardest tests by input length, each with a 6–12 s
timeout; 0 on any failure or when the completion has no ```` ```python ```` block. No partial
credit (K/N rewards invite printing memorised public-test outputs).

Two test formats:

* `StdioTest` (LiveCodeBench / Codeforces / APPS): the program reads stdin, its stdout is
  compared with the expected output line by line, ignoring trailing whitespace and trailing empty
  lines; numeric tokens may differ by `CodeRewardConfig.float_tolerance`.
* `FunctionTest` (HumanEval / MBPP): a snippet (asserts, ``check(candidate)``) executed after the
  solution in its namespace; it passes if it raises nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards._base import RewardResult, as_config
from jaxrl.rewards._sandbox import ExecResult, SandboxConfig, run_function_tests, run_program

__all__ = [
  "CodeRewardConfig",
  "CodeRunResult",
  "FunctionTest",
  "StdioTest",
  "code_reward",
  "extract_code",
  "outputs_match",
  "parse_tests",
  "run_tests",
  "select_tests",
]


@dataclasses.dataclass(frozen=True)
class StdioTest:
  """Feed `input` on stdin; expect `output` on stdout."""

  input: str
  output: str


@dataclasses.dataclass(frozen=True)
class FunctionTest:
  """A Python snippet run after the solution in the same namespace (passes if it raises nothing)."""

  code: str


Test = StdioTest | FunctionTest


def parse_tests(tests: Any) -> list[Test]:
  """Reads tests from the shapes datasets use.

  Accepts a JSON string of any of: a list of `StdioTest`/`FunctionTest`; a list of dicts with
  ``input``/``output`` (stdio) or ``code``/``assert``/``test`` (function); the APPS/TACO dict
  ``{"inputs": [...], "outputs": [...]}``; or a list of assert strings (MBPP's ``test_list``).
  """
  if isinstance(tests, str):
    tests = json.loads(tests)
  if isinstance(tests, Mapping):
    if "inputs" in tests and "outputs" in tests:
      if "fn_name" in tests:
        raise ValueError(
          "tests: call-based APPS tests (fn_name) are not supported; convert them to FunctionTest asserts"
        )
      ins, outs = tests["inputs"], tests["outputs"]
      if len(ins) != len(outs):
        raise ValueError(f"tests: {len(ins)} inputs but {len(outs)} outputs")
      return [StdioTest(_text(i), _text(o)) for i, o in zip(ins, outs)]
    raise ValueError(f"tests: unrecognised mapping with keys {sorted(tests)}")
  out: list[Test] = []
  for k, t in enumerate(tests):
    if isinstance(t, (StdioTest, FunctionTest)):
      out.append(t)
    elif isinstance(t, str):
      out.append(FunctionTest(t))
    elif isinstance(t, Mapping) and "input" in t and "output" in t:
      out.append(StdioTest(_text(t["input"]), _text(t["output"])))
    elif isinstance(t, Mapping) and any(key in t for key in ("code", "assert", "test")):
      out.append(FunctionTest(next(str(t[key]) for key in ("code", "assert", "test") if key in t)))
    else:
      raise ValueError(f"tests[{k}]: cannot read {type(t).__name__} {str(t)[:80]!r} as a test")
  return out


def _text(x: Any) -> str:
  if isinstance(x, str):
    return x
  if isinstance(x, (list, tuple)):
    return "\n".join(map(str, x))
  return str(x)


def select_tests(tests: Sequence[Test], k: int | None = 15) -> list[Test]:
  """DeepCoder's sample: the `k` hardest tests by input length (function tests: code length).

  Ties keep dataset order; the result is ordered hardest first. ``k=None`` keeps all.
  """
  size = lambda t: len(t.input) if isinstance(t, StdioTest) else len(t.code)  # noqa: E731
  ranked = sorted(range(len(tests)), key=lambda i: (-size(tests[i]), i))
  if k is not None:
    ranked = ranked[:k]
  return [tests[i] for i in ranked]


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
  """``(info string, body)`` of each fenced block, reading fences line by line."""
  blocks, lang, body = [], None, []
  for line in text.splitlines(keepends=True):
    stripped = line.strip()
    if lang is None:
      if stripped.startswith("```"):
        lang, body = stripped[3:].strip().lower(), []
    elif stripped == "```":
      blocks.append((lang, "".join(body)))
      lang = None
    else:
      body.append(line)
  return blocks


def extract_code(completion: str, *, require_block: bool = True) -> str | None:
  """The last fenced code block of `completion`, preferring blocks tagged ``python``/``py``.

  Without a block returns None, or the whole completion when `require_block` is False.
  """
  blocks = _fenced_blocks(completion)
  tagged = [body for lang, body in blocks if lang in ("python", "python3", "py")]
  if tagged:
    return tagged[-1]
  untagged = [body for lang, body in blocks if not lang]
  if untagged:
    return untagged[-1]
  return None if require_block else completion


_NUM = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def outputs_match(got: str, expected: str, *, float_tolerance: float | None = 1e-6) -> bool:
  """Line-wise comparison ignoring trailing whitespace and trailing blank lines.

  When lines differ, they still match if they have the same tokens with numeric tokens within
  `float_tolerance` (absolute or relative); ``None`` disables that.
  """
  a = [line.rstrip() for line in got.strip("\n").rstrip().splitlines()]
  b = [line.rstrip() for line in expected.strip("\n").rstrip().splitlines()]
  if a == b:
    return True
  if float_tolerance is None or len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    tx, ty = x.split(), y.split()
    if len(tx) != len(ty):
      return False
    for u, v in zip(tx, ty):
      if u == v:
        continue
      if not (_NUM.match(u) and _NUM.match(v)):
        return False
      if not math.isclose(float(u), float(v), rel_tol=float_tolerance, abs_tol=float_tolerance):
        return False
  return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeRewardConfig:
  """Test selection, limits and reward values of `code_reward`."""

  timeout_s: float = 6.0
  """Wall-clock limit per test (DeepCoder: 6–12 s)."""
  max_tests: int | None = 15
  """Run only this many hardest tests (`select_tests`); None runs all."""
  stop_on_first_failure: bool = True
  """Stop at the first failing test (the reward is 0 either way)."""
  require_code_block: bool = True
  """A completion without a fenced code block scores `incorrect_value` (reason ``no_code``)."""
  float_tolerance: float | None = 1e-6
  """Tolerance for numeric tokens in stdio outputs; None compares text only."""
  correct_value: float = 1.0
  """Reward when every selected test passes."""
  incorrect_value: float = 0.0
  """Reward otherwise."""
  sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
  """Limits and isolation of each run."""

  def __post_init__(self):
    if not self.timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
    if self.max_tests is not None and self.max_tests < 1:
      raise ValueError(f"max_tests must be >= 1 or None, got {self.max_tests!r}")
    if self.float_tolerance is not None and not self.float_tolerance >= 0:
      raise ValueError(f"float_tolerance must be >= 0 or None, got {self.float_tolerance!r}")


@dataclasses.dataclass(frozen=True)
class CodeRunResult:
  """Outcome of `run_tests`: overall verdict and one entry per test run."""

  passed: bool
  reason: str
  """``passed`` or the first failing test's reason (``wrong_answer``, ``timeout``,
  ``runtime_error``, ``memory``, ``output_limit``, ``file_size_limit``, ``syntax_error``,
  ``killed``), ``no_tests``."""
  tests: tuple[dict[str, Any], ...]
  """Per run: kind, reason, wall_s, the head of stdout (wrong answers), the tail of stderr
  (crashes), and the sandbox pid/uid (diagnostics; both are gone by then)."""


def _verdict(res: ExecResult, expected: str | None, tol: float | None) -> str:
  if res.status != "ok":
    return res.status
  if expected is not None and not outputs_match(res.stdout, expected, float_tolerance=tol):
    return "wrong_answer"
  return "passed"


def run_tests(code: str, tests: Sequence[Test], *, config: CodeRewardConfig | None = None) -> CodeRunResult:
  """Runs `code` against `tests` (already selected) in the sandbox.

  Stdio tests run one process each; all function tests of a call run in one process, each test
  with its own `timeout_s` alarm.
  """
  cfg = config or CodeRewardConfig()
  if not tests:
    return CodeRunResult(False, "no_tests", ())
  records: list[dict[str, Any]] = []
  stdio = [t for t in tests if isinstance(t, StdioTest)]
  funcs = [t.code for t in tests if isinstance(t, FunctionTest)]
  first_fail = None
  if funcs:
    res = run_function_tests(code, funcs, timeout_s=cfg.timeout_s, config=cfg.sandbox)
    verdict = _verdict(res, None, None)
    records.append({"kind": "function", "n": len(funcs), "reason": verdict, "wall_s": round(res.wall_s, 3),
                    "stderr": res.stderr[-500:] if verdict != "passed" else "", "pid": res.pid, "uid": res.uid})
    if verdict != "passed":
      first_fail = verdict
  for k, t in enumerate(stdio):
    if first_fail is not None and cfg.stop_on_first_failure:
      break
    res = run_program(code, stdin=t.input, timeout_s=cfg.timeout_s, config=cfg.sandbox)
    verdict = _verdict(res, t.output, cfg.float_tolerance)
    records.append({"kind": "stdio", "index": k, "reason": verdict, "wall_s": round(res.wall_s, 3),
                    "stdout": res.stdout[:200] if verdict == "wrong_answer" else "",
                    "stderr": res.stderr[-500:] if verdict not in ("passed", "wrong_answer") else "",
                    "pid": res.pid, "uid": res.uid})
    if verdict != "passed" and first_fail is None:
      first_fail = verdict
  return CodeRunResult(first_fail is None, first_fail or "passed", tuple(records))


def code_reward(
  prompt: str, completion: str, *, tests: Any, config: CodeRewardConfig | dict | None = None, **_: Any
) -> RewardResult:
  """DeepCoder's all-tests-pass reward for a completion holding a Python program.

  Args:
    prompt: unused (part of the reward signature).
    completion: model output; the program is its last ```` ```python ```` block.
    tests: the problem's tests in any shape `parse_tests` reads.
    config: a `CodeRewardConfig` or a dict of its fields.

  Returns:
    ``RewardResult`` with ``info["reason"]`` (``passed``, ``no_code`` or the first failure's
    reason) and ``info["tests"]`` (per-run records).
  """
  cfg = as_config(CodeRewardConfig, config, "config")
  code = extract_code(completion, require_block=cfg.require_code_block)
  if code is None:
    return RewardResult(value=cfg.incorrect_value, info={"reason": "no_code"})
  selected = select_tests(parse_tests(tests), cfg.max_tests)
  result = run_tests(code, selected, config=cfg)
  value = cfg.correct_value if result.passed else cfg.incorrect_value
  return RewardResult(value=value, info={"reason": result.reason, "tests": list(result.tests),
                                         "n_tests": len(selected)})
