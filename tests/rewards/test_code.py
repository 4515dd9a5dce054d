"""Code reward: test formats, DeepCoder test selection, extraction, verdict reasons."""

import pytest

from jaxrl.rewards import (
  CodeRewardConfig,
  FunctionTest,
  StdioTest,
  code_reward,
  extract_code,
  outputs_match,
  parse_tests,
  select_tests,
)

ECHO_SUM = "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```"
STDIO = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 20 30", "output": "60"}]


def test_stdio_program_passing_all_tests_scores_one():
  r = code_reward("", ECHO_SUM, tests=STDIO)
  assert (r.value, r.info["reason"], r.info["n_tests"]) == (1.0, "passed", 2)


def test_one_failing_stdio_test_scores_zero():
  tests = STDIO + [{"input": "1 1", "output": "3"}]
  r = code_reward("", ECHO_SUM, tests=tests)
  assert (r.value, r.info["reason"]) == (0.0, "wrong_answer")


def test_function_tests_humaneval_and_mbpp_style():
  sol = "```python\ndef add(a, b):\n  return a + b\n```"
  mbpp = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
  humaneval = [{"test": "def check(candidate):\n  assert candidate(2, 2) == 4\n\ncheck(add)"}]
  assert code_reward("", sol, tests=mbpp).value == 1.0
  assert code_reward("", sol, tests=humaneval).value == 1.0
  r = code_reward("", sol, tests=mbpp + ["assert add(2, 2) == 5"])
  assert (r.value, r.info["reason"]) == (0.0, "wrong_answer")


def test_exiting_early_does_not_pass_function_tests():
  for exit_call in ("import os; os._exit(0)", "import sys; sys.exit(0)", "raise SystemExit"):
    sol = f"```python\ndef add(a, b):\n  return 0\n{exit_call}\n```"
    r = code_reward("", sol, tests=["assert add(1, 2) == 3"])
    assert (r.value, r.info["reason"]) == (0.0, "runtime_error"), exit_call


def test_function_test_timeout_is_per_test():
  sol = "```python\ndef f():\n  while True:\n    pass\n```"
  r = code_reward("", sol, tests=["f()"], config={"timeout_s": 1.0})
  assert (r.value, r.info["reason"]) == (0.0, "timeout")


@pytest.mark.parametrize("program, reason", [
  ("print(", "syntax_error"),
  ("raise ValueError('x')", "runtime_error"),
  ("import sys; sys.exit(3)", "runtime_error"),
  ("x = [0] * (10 ** 10)", "memory"),
])
def test_failure_reasons(program, reason):
  r = code_reward("", f"```python\n{program}\n```", tests=STDIO[:1])
  assert (r.value, r.info["reason"]) == (0.0, reason)


def test_missing_code_block_scores_zero_unless_allowed():
  bare = "import sys\nprint(sum(map(int, sys.stdin.read().split())))"
  assert code_reward("", bare, tests=STDIO).info["reason"] == "no_code"
  assert code_reward("", bare, tests=STDIO, config={"require_code_block": False}).value == 1.0


def test_reward_values_configurable():
  cfg = CodeRewardConfig(correct_value=5.0, incorrect_value=-5.0)
  assert code_reward("", ECHO_SUM, tests=STDIO, config=cfg).value == 5.0
  assert code_reward("", "no code", tests=STDIO, config=cfg).value == -5.0


def test_select_tests_takes_the_15_longest_inputs_hardest_first():
  tests = [StdioTest("x" * n, "") for n in (3, 40, 7, 40, 1, *range(100, 120))]
  chosen = select_tests(tests)
  assert len(chosen) == 15
  assert [len(t.input) for t in chosen] == list(range(119, 104, -1))
  assert [len(t.input) for t in select_tests(tests[:5], k=3)] == [40, 40, 7]
  assert select_tests(tests[:5], k=3)[0] is tests[1]  # ties keep dataset order


def test_only_the_selected_tests_run():
  # the failing test has the shortest input, so it is not among the 2 hardest
  tests = [{"input": "1 1", "output": "wrong"}, {"input": "100 200", "output": "300"},
           {"input": "1000 2000", "output": "3000"}]
  assert code_reward("", ECHO_SUM, tests=tests, config={"max_tests": 2}).value == 1.0
  assert code_reward("", ECHO_SUM, tests=tests, config={"max_tests": None}).value == 0.0


def test_extract_code_prefers_last_python_block():
  text = "```text\nnot code\n```\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```"
  assert extract_code(text) == "print(2)\n"
  assert extract_code("```\nprint(3)\n```") == "print(3)\n"
  assert extract_code("print(4)") is None


@pytest.mark.parametrize("got, expected, match", [
  ("1 2\n3\n", "1 2\n3", True),
  ("1 2  \n3\n\n\n", "1 2\n3", True),
  ("0.3333333333\n", "0.333333333", True),
  ("1.5\n", "1.6", False),
  ("YES\n", "yes", False),
  ("1\n2\n", "1 2", False),
])
def test_outputs_match(got, expected, match):
  assert outputs_match(got, expected) is match


def test_parse_tests_reads_dataset_shapes():
  assert parse_tests('{"inputs": ["1\\n"], "outputs": ["2\\n"]}') == [StdioTest("1\n", "2\n")]
  assert parse_tests(["assert f()"]) == [FunctionTest("assert f()")]
  assert parse_tests([{"input": ["a", "b"], "output": "c"}]) == [StdioTest("a\nb", "c")]
  with pytest.raises(ValueError, match="fn_name"):
    parse_tests({"inputs": [[1]], "outputs": [[2]], "fn_name": "f"})
  with pytest.raises(ValueError, match=r"tests\[0\]"):
    parse_tests([42])


def test_extract_code_ignores_other_languages():
  assert extract_code("```cpp\nint main() {}\n```") is None
  assert extract_code("```python\nprint(1)\n```", require_block=False) == "print(1)\n"
