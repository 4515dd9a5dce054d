"""The metric functions of ``jaxrl.eval`` against hand-computed cases and independent references."""

import itertools
import math

import numpy as np
import pytest
from eval_testlib import maj_reference, pass_at_k_comb, pass_at_k_enum

from jaxrl import eval as ev


@pytest.mark.parametrize("n,c,k,want", [
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),          # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (16, 4, 1, 0.25),        # pass@1 = c/n
    (10, 3, 2, 1 - 21 / 45),  # 1 - C(7,2)/C(10,2)
    (16, 0, 16, 0.0),
    (16, 1, 16, 1.0),
    (6, 4, 3, 1.0),          # n - c < k: every 3-subset holds a correct one
])
def test_pass_at_k_hand_computed(n, c, k, want):
  assert ev.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_equals_closed_form_and_enumeration():
  for n in range(1, 8):
    for c in range(n + 1):
      correct = [True] * c + [False] * (n - c)
      for k in range(1, n + 1):
        got = ev.pass_at_k(n, c, k)
        assert got == pytest.approx(float(pass_at_k_comb(n, c, k)), abs=1e-12), (n, c, k)
        assert got == pytest.approx(float(pass_at_k_enum(correct, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_overflow():
  n, c, k = 2000, 7, 900  # C(2000, 900) overflows a float
  assert math.comb(n, k) > 10**308
  assert ev.pass_at_k(n, c, k) == pytest.approx(float(pass_at_k_comb(n, c, k)), rel=1e-12)


def test_pass_at_k_rejects_bad_counts():
  for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
    with pytest.raises(ValueError):
      ev.pass_at_k(n, c, k)


def test_avg_at_k_is_mean_of_first_k():
  correct = [True, False, True, True, False, False]
  assert ev.avg_at_k(correct, 6) == pytest.approx(0.5)
  assert ev.avg_at_k(correct, 4) == pytest.approx(0.75)
  assert ev.avg_at_k(correct, 1) == 1.0
  # avg@n equals pass@1 (the unbiased estimator at k = 1)
  assert ev.avg_at_k(correct, 6) == pytest.approx(ev.pass_at_k(6, 3, 1))


def test_maj_at_k_normalises_and_breaks_ties_by_first_appearance():
  # "1/2", "\\dfrac12" and "0.5 cm"-free "\\frac{1}{2}" are one answer after normalisation: 3 votes beat "7"'s 2
  answers = ["7", "1/2", "\\dfrac12", "7", "\\frac{1}{2}"]
  assert ev.majority_index(answers, 5) == 1
  assert ev.maj_at_k([False, True, True, False, True], answers, 5) == 1.0
  # first 4: a 2-2 tie between "7" (seen at 0) and 1/2 (seen at 1): "7" wins
  assert ev.majority_index(answers, 4) == 0
  assert ev.maj_at_k([False, True, True, False, True], answers, 4) == 0.0
  # samples without an answer do not vote; none at all scores 0
  assert ev.majority_index([None, None, "3"], 3) == 2
  assert ev.maj_at_k([True, True, False], [None, None, None], 3) == 0.0


def test_maj_at_k_matches_a_counter_reference():
  rng = np.random.default_rng(0)
  pool = ["1", "2", "\\frac{1}{2}", "1/2", "0.5", None, "x = 2", "(B)", "B"]
  for _ in range(300):
    n = int(rng.integers(1, 9))
    answers = [pool[i] for i in rng.integers(0, len(pool), n)]
    correct = [bool(b) for b in rng.integers(0, 2, n)]
    for k in range(1, n + 1):
      assert ev.maj_at_k(correct, answers, k) == maj_reference(correct, answers, k), (answers, correct, k)


def test_parse_metrics():
  assert ev.parse_metrics(ev.DEFAULT_METRICS, 16) == ["avg@16", "pass@1", "pass@16", "maj@16"]
  assert ev.parse_metrics("pass@k, maj@4,pass@1,pass@1", 8) == ["pass@8", "maj@4", "pass@1"]
  for bad in ("pass@0", "pass@9", "best@2", "pass@", ""):
    with pytest.raises(ValueError):
      ev.parse_metrics(bad, 8)


def test_summarize_averages_problems_equally():
  correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  answers = [["3", "4", "4", None], ["1"] * 4, [None] * 4]
  got = ev.summarize(correct, ["avg@4", "pass@1", "pass@2", "pass@4", "maj@4"], answers)
  assert got["avg@4"] == pytest.approx((0.25 + 1 + 0) / 3)
  assert got["pass@1"] == pytest.approx(got["avg@4"])
  assert got["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
  assert got["pass@4"] == pytest.approx(2 / 3)
  assert got["maj@4"] == pytest.approx(1 / 3)  # "4" wins problem 0 (wrong), "1" problem 1


def test_math_scorer_scores_and_extracts():
  with ev.make_scorer("math") as scorer:
    idx = [scorer.submit("Q", "so \\boxed{\\dfrac12}", answer="0.5"), scorer.submit("Q", "it is 3", answer="4")]
    batch = scorer.collect(idx)
  assert batch.rewards.tolist() == [1.0, 0.0]
  assert [i.get("extracted") for i in batch.infos] == ["\\dfrac12", "3"]


def test_brute_force_reference_itself():
  # the enumeration reference is not the closed form by construction: check it on a listed case
  assert pass_at_k_enum([True, False, False, False], 2) == sum(
      0 in s for s in itertools.combinations(range(4), 2)) / 6
