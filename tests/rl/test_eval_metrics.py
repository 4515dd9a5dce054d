"""The RL trainer's held-out evaluation reports `jaxrl eval`'s metrics (avg@k, unbiased pass@k, maj@k) from the
same functions: checked on a stub trainer against numbers worked out by hand."""

import types

import numpy as np
import pytest

from jaxrl import rl


def _stub(rewards, answers, metrics):
  """The attributes :meth:`RLTrainer.evaluate` reads: 2 prompts x 4 samples scored as ``rewards``."""
  p, n = rewards.shape
  ev = rl.RLEvalConfig(prompts=p, samples=n, temperature=1.0, metrics=metrics)
  out = types.SimpleNamespace(lengths=np.full(p * n, 5, np.int32))
  scored = types.SimpleNamespace(rewards=rewards.reshape(-1),
                                 infos=tuple({"extracted": a} for a in np.asarray(answers, object).reshape(-1)))
  return types.SimpleNamespace(
      eval_completions=lambda step, temperature=None, samples=None: (list(range(p)), out, ev),
      _score=lambda prompts, idx, k, got: scored, procs=1, pid=0, heldout_prompts=[None] * p,
      cfg=types.SimpleNamespace(reward=types.SimpleNamespace(correct_threshold=0.5)))


def test_evaluate_reports_avg_pass_and_majority_as_jaxrl_eval_does():
  rewards = np.array([[1.0, 0.0, 0.0, 0.0],  # 1 of 4 correct; the wrong answers "7" outvote the right "5"
                      [0.0, 1.0, 1.0, 0.0]])  # 2 of 4 correct; "9" (wrong) and "3" (right) tie 2-2
  answers = [["5", "7", "7", "8"], ["9", "3", "3", "9"]]
  got = rl.RLTrainer.evaluate(_stub(rewards, answers, "pass@1,pass@2,maj@4"), 0)
  assert got["eval/accuracy"] == pytest.approx((1 / 4 + 2 / 4) / 2)
  assert got["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
  # pass@2 = 1 - C(n-c, 2) / C(n, 2): problem 1: 1 - C(3,2)/C(4,2) = 1/2; problem 2: 1 - C(2,2)/C(4,2) = 5/6
  assert got["eval/pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)
  assert got["eval/pass@4"] == pytest.approx(1.0)
  # maj@4: problem 1 votes "7" (wrong); problem 2 ties "9" and "3" 2-2 and the first sample's answer, "9", wins
  assert got["eval/maj@4"] == pytest.approx(0.0)
  assert got["eval/reward_mean"] == pytest.approx(3 / 8) and got["eval/length_mean"] == 5


def test_majority_counts_the_right_answer_when_it_wins():
  rewards = np.array([[0.0, 1.0, 1.0, 0.0]])
  got = rl.RLTrainer.evaluate(_stub(rewards, [["9", "3", "3", "4"]], "maj@4"), 0)
  assert got["eval/maj@4"] == 1.0 and "eval/pass@1" not in got


def test_a_bad_metric_name_is_refused_when_the_config_is_read():
  with pytest.raises(ValueError, match="eval.metrics"):
    rl.RLEvalConfig(samples=4, temperature=1.0, metrics="best@4")
