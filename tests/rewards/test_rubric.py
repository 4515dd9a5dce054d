"""Rubric rewards (RaR, Rubric Anchors, pairwise, AlignXplore) and Auto-Rubric's coding-rate selection."""

import functools

import numpy as np
import pytest
from judge_testlib import start_fake

from jaxrl import rewards


_SERVERS = {}


@pytest.fixture(scope="module")
def judge():
  srv = start_fake()
  _SERVERS[srv.url] = srv
  yield {"base_url": srv.url, "backoff_s": 0.01, "max_retries": 0}
  srv.stop()


def judge_bodies(judge):
  return _SERVERS[judge["base_url"]].server.config.app.state.bodies


def test_explicit_rubric_reward_is_the_weighted_share(judge):
  rubric = [{"criterion": "[[ok:Score: 1]] names the diagnosis", "weight": 1.0},
            {"criterion": "[[ok:Score: 0]] mentions the dose", "category": "important"},
            {"criterion": "[[ok:Score: 1]] avoids unsafe advice", "category": "pitfall"}]
  r = rewards.rubric_reward("q", "answer", rubric=rubric, judge=judge, aggregation="explicit", mode="text")
  assert r.info["met"] == [1.0, 0.0, 1.0]
  assert r.value == pytest.approx((1.0 + 0.9) / (1.0 + 0.7 + 0.9))
  assert rewards.explicit_rubric_score([1, 0, 1], [1.0, 0.7, 0.3]) == pytest.approx(1.3 / 2.0)


def test_implicit_rubric_reward_is_the_normalised_holistic_score(judge):
  r = rewards.rubric_reward("q", "[[ok:Score: 6]]", rubric=["is correct", "is concise"], judge=judge, mode="text")
  assert r.value == pytest.approx(6 / 9)
  with pytest.raises(ValueError, match="rubric\\[0\\].weight"):
    rewards.rubric_reward("q", "a", rubric=[{"criterion": "c", "weight": -1}], judge=judge)


def test_anchor_aggregation_veto_and_saturation(judge):
  assert rewards.anchor_aggregate([1.0, 0.5], [1.0, 1.0], caps=[0.8, 1.0]) == pytest.approx(0.75)
  assert rewards.anchor_aggregate([0.9, 0.2], [2.0, 1.0], veto=[False, True]) == 0.0
  assert rewards.anchor_aggregate([0.9, 0.6], [2.0, 1.0], veto=[False, True]) == pytest.approx((1.8 + 0.6) / 3)
  dims = [{"criterion": "[[ok:Score: 2]] tone", "tiers": ["flat", "ok", "vivid"], "weight": 2.0},
          {"criterion": "[[ok:Score: 0]] no sycophancy", "tiers": ["flatters", "clean"], "veto": True}]
  assert rewards.rubric_anchor_reward("q", "a", dimensions=dims, judge=judge, mode="text").value == 0.0
  dims[1]["criterion"] = "[[ok:Score: 1]] no sycophancy"
  assert rewards.rubric_anchor_reward("q", "a", dimensions=dims, judge=judge, mode="text").value == 1.0


def test_pairwise_swap_averages_out_position_bias(judge):
  # The judge always answers "A": preferred in one order, not in the other.
  r = rewards.pairwise_judge_reward("q", "[[ok:Answer: A]]", reference="ref", judge=judge, mode="text")
  assert (r.value, r.info["p_orders"]) == (0.5, [1.0, 0.0])
  assert rewards.pairwise_judge_reward("q", "[[ok:Answer: A]]", reference="ref", judge=judge, mode="text",
                                       swap=False).value == 1.0


def test_alignxplore_formulas_on_hand_built_pairs():
  # eq. 6: margins log R(y|x,d) - log R(y|x) of y_w and y_l
  cases = [((-10.0, -12.0, -9.0, -10.0), 1.0), ((-10.0, -11.0, -9.0, -11.0), 0.0), ((-5.0, -5.0, -5.0, -5.0), 0.0)]
  for (a, b, c, d), want in cases:
    assert rewards.alignxplore_r_gen(a, b, c, d, True) == want == float((a - b) > (c - d))
    assert rewards.alignxplore_r_gen(a, b, c, d, False) == 0.0
  # eq. 7
  assert [rewards.alignxplore_r_jud(pw, pl, True) for pw, pl in [(0.7, 0.3), (0.3, 0.7), (0.5, 0.5)]] == [1.0, 0.0, 0.0]


def test_alignxplore_rewards_end_to_end(judge):
  good = "<think>likes short answers</think><preference>[[ok:Answer: A]] brevity</preference>"
  fields = dict(post="hi", chosen="short", rejected="a very long answer")
  assert rewards.alignxplore_jud_reward("E", good, judge=judge, swap=False, mode="text", **fields).value == 1.0
  assert rewards.alignxplore_jud_reward("E", "no tags", judge=judge, **fields).value == 0.0
  table = {("User preference: brevity\n\nhi", "short"): -3.0, ("hi", "short"): -5.0,
           ("User preference: brevity\n\nhi", "a very long answer"): -9.0, ("hi", "a very long answer"): -8.0}
  gen = "<think>r</think><preference>brevity</preference>"
  r = rewards.alignxplore_gen_reward("E", gen, logprob_fn=lambda c, y: table[(c, y)], **fields)
  assert r.value == rewards.alignxplore_r_gen(-3.0, -5.0, -9.0, -8.0, True) == 1.0


def test_judge_reward_composes_with_format(judge):
  fn = rewards.weighted_sum({"judge": functools.partial(rewards.judge_reward, judge=judge, mode="text",
                                                        template="{completion}"),
                             "len": lambda p, c, **_: float(len(c) > 3)}, {"judge": 0.5})
  r = fn("q", "[[ok:Score: 9]]")
  assert r.value == pytest.approx(0.5 * 1.0 + 1.0)


def _reference_rate(E, eps):
  r = E.shape[1]
  return 0.5 * np.linalg.slogdet(np.eye(r) + E.T @ E / (eps**2 * r))[1]


def test_coding_rate_matches_numpy_float64():
  rng = np.random.default_rng(0)
  for r, eps in [(1, 0.5), (4, 0.3), (9, 1.0)]:
    E = rng.normal(size=(16, r))
    assert rewards.coding_rate(E, eps) == pytest.approx(_reference_rate(E, eps), rel=1e-12, abs=1e-12)


def _greedy_reference(X, eps, tau, patience):
  X = X / np.linalg.norm(X, axis=1, keepdims=True)
  chosen, low, cur = [], 0, 0.0
  while len(chosen) < len(X):
    rates = {i: _reference_rate(X[chosen + [i]].T, eps) for i in range(len(X)) if i not in chosen}
    i = min(j for j, v in rates.items() if v >= max(rates.values()) - 1e-12)
    gain, cur = rates[i] - cur, rates[i]
    chosen.append(i)
    low = low + 1 if gain < tau else 0
    if low >= patience:
      return chosen[:-patience]
  return chosen


def test_selection_picks_distinct_rubrics_and_stops_by_tau_and_patience():
  rng = np.random.default_rng(1)
  base = np.linalg.qr(rng.normal(size=(32, 4)))[0].T  # 4 orthonormal directions
  dups = np.repeat(base, 3, axis=0) + 1e-3 * rng.normal(size=(12, 32))  # 3 near-duplicates of each
  sel = rewards.select_rubrics(dups, eps=0.5)
  assert sorted(i // 3 for i in sel.indices) == [0, 1, 2, 3]  # one of each direction, no duplicate
  assert sel.stopped_early and all(g >= 0.002 for g in sel.gains)
  assert sel.indices == _greedy_reference(dups, 0.5, 0.002, 2)
  # The rates after each pick are the numpy coding rates of the prefix sets.
  X = dups / np.linalg.norm(dups, axis=1, keepdims=True)
  for k in range(1, len(sel.indices) + 1):
    assert sel.rates[k - 1] == pytest.approx(_reference_rate(X[sel.indices[:k]].T, 0.5), abs=1e-12)


def test_hashing_embedder_groups_paraphrases():
  emb = rewards.HashingEmbedder(256)(["Prioritize clarity and structure", "prioritize clarity and structure.",
                                      "Ensure narrative fidelity"])
  cos = lambda a, b: a @ b / np.linalg.norm(a) / np.linalg.norm(b)
  assert cos(emb[0], emb[1]) == pytest.approx(1.0) and abs(cos(emb[0], emb[2])) < 0.5


def test_propose_evaluate_revise_and_metrics(judge):
  # The fake judge answers every prompt with the tag in the query: a rubric list that also says [[A]].
  rubrics, ok, rounds = rewards.propose_evaluate_revise("[[ok:- be clear\n- be right\nAnswer: A]]", "good", "bad",
                                                       judge=judge, e_max=3)
  assert (rubrics, ok, rounds) == (["be clear", "be right"], True, 1)
  calls = len(judge_bodies(judge))
  _, ok, rounds = rewards.propose_evaluate_revise("[[ok:- be long\nAnswer: B]]", "good", "bad", judge=judge, e_max=3)
  assert (ok, rounds) == (False, 3)
  assert len(judge_bodies(judge)) - calls == 1 + 3 * 2  # propose, then (evaluate, revise) x E_max
  verdict = {"clear": "A", "long": "B", "tone": None}
  evaluate = lambda rs, x, a, b: "A" if "clear" in rs else verdict[rs[0]]
  m = rewards.rubric_metrics(["clear", "long", "tone"], [("x", "a", "b")] * 4, evaluate)
  assert [d["coverage"] for d in m] == [1.0, 1.0, 0.0]
  assert [d["precision"] for d in m[:2]] == [1.0, 0.0]
  assert [d["contribution"] for d in m] == [1.0, 0.0, 0.0]
