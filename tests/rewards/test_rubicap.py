"""RubiCap: severity weights, the two-teacher consensus rule, malformed rubric JSON, the weighted reward and
the self-praise / length monitor."""

import json

import numpy as np
import pytest
from judge_testlib import start_fake

from jaxrl import rewards

TEACHERS = ["A carrot cake with the words 24 CARROT CAKE sits on a wooden table.",
            "On a wooden table is a cake; its icing reads '24 Carrot Cake'. A fork lies beside it.",
            "A cake on a table next to a red mug."]


@pytest.fixture(scope="module")
def judge():
  srv = start_fake()
  yield {"base_url": srv.url, "max_retries": 0}
  srv.stop()


def test_severity_parsing():
  assert [rewards.severity_weight(s) for s in ("critical", "Important", " MINOR ", 3, 2.0, 1)] == [3, 2, 1, 3, 2, 1]
  for bad in ("severe", None, 4, True, ""):
    with pytest.raises(ValueError, match="rubrics\\[1\\].severity"):
      rewards.severity_weight(bad, "rubrics[1].severity")


def test_two_teacher_consensus_is_checked_against_the_teachers_quotes():
  reply = {"rubrics": [
    # Two teachers state the text, with quotes found in their captions (case and punctuation folded): kept.
    {"criterion": "Mentions the text '24 CARROT CAKE'", "severity": "critical",
     "support": [{"teacher": 1, "quote": "24 CARROT CAKE"}, {"teacher": 2, "quote": "reads 24 carrot cake"}]},
    # Only teacher 3 mentions the mug: one teacher is not consensus.
    {"criterion": "Mentions the red mug", "severity": "minor", "support": [{"teacher": 3, "quote": "red mug"}]},
    # The writer claims two teachers, but teacher 1 never says "fork": only one verified.
    {"criterion": "Mentions the fork", "severity": "important",
     "support": [{"teacher": 1, "quote": "a fork"}, {"teacher": 2, "quote": "A fork lies beside it"}]},
    # The same teacher twice counts once.
    {"criterion": "Says the table is wooden", "severity": "minor",
     "support": [{"teacher": 2, "quote": "wooden table"}, {"teacher": 2, "quote": "a wooden table"}]},
    # Three teachers: kept.
    {"criterion": "Says there is a table", "severity": 2,
     "support": [{"teacher": t, "quote": "table"} for t in (1, 2, 3)]},
  ]}
  text = "Here are the rubrics:\n```json\n" + json.dumps(reply) + "\n```"
  kept, counts = rewards.parse_rubric_reply(text, TEACHERS)
  assert [(k["criterion"], k["weight"], k["teachers"]) for k in kept] == [
    ("Mentions the text '24 CARROT CAKE'", 3.0, [1, 2]), ("Says there is a table", 2.0, [1, 2, 3])]
  assert kept[1]["severity"] == "important" and counts == {"proposed": 5, "unsupported": 3}
  kept1, _ = rewards.parse_rubric_reply(text, TEACHERS, min_support=1)
  assert len(kept1) == 5


def test_malformed_writer_replies_and_rubric_files_name_the_place():
  with pytest.raises(ValueError, match="committee.jsonl:3: the rubric writer's answer is not JSON"):
    rewards.parse_rubric_reply('{"rubrics": [', TEACHERS, where="committee.jsonl:3")
  with pytest.raises(ValueError, match="rubrics\\[0\\].support\\[0\\].teacher: 4 is not a teacher number 1..3"):
    rewards.parse_rubric_reply(json.dumps({"rubrics": [{"criterion": "c", "severity": "minor",
                                                        "support": [{"teacher": 4, "quote": "x"}]}]}), TEACHERS)
  with pytest.raises(ValueError, match="rubrics\\[0\\].severity"):
    rewards.parse_rubric_reply(json.dumps({"rubrics": [{"criterion": "c", "severity": "huge", "support": []}]}),
                               TEACHERS)
  good = json.dumps({"rubrics": [{"criterion": "c", "severity": "minor"}]})
  assert rewards.read_rubric_lines([good, "", good], "r.jsonl") == [[{"criterion": "c", "weight": 1.0}]] * 2
  with pytest.raises(ValueError, match="r.jsonl:2: not JSON"):
    rewards.read_rubric_lines([good, "{oops", good], "r.jsonl")
  with pytest.raises(ValueError, match="r.jsonl:1: rubrics\\[0\\].severity"):
    rewards.read_rubric_lines([json.dumps({"rubrics": [{"criterion": "c", "severity": "x"}]})], "r.jsonl")


def test_reward_is_the_weighted_normalised_fraction_met(judge):
  # The fake judge answers each criterion by the tag it carries: met, not met, met.
  rubrics = [{"criterion": "[[ok:Score: 1]] names the cake text", "severity": "critical"},
             {"criterion": "[[ok:Score: 0]] mentions the fork", "severity": "important"},
             {"criterion": "[[ok:Score: 1]] says the table is wooden", "severity": "minor"}]
  r = rewards.rubicap_reward("Describe.", "A cake reading 24 CARROT CAKE on a wooden table.", rubrics=rubrics,
                             judge=judge, mode="text")
  assert r.info["met"] == [1.0, 0.0, 1.0]
  assert r.value == pytest.approx((3.0 + 1.0) / (3.0 + 2.0 + 1.0))   # 4/6, by hand
  none = rewards.rubicap_reward("D", "c", rubrics=[], judge=judge)
  assert none.value == 1.0 and none.info["reason"] == "no_rubrics"
  assert rewards.load_reward("rubicap") is rewards.rubicap_reward


def test_weights_change_the_value_when_the_failures_differ_in_severity(judge):
  crit_met = [{"criterion": "[[ok:Score: 1]] a", "severity": "critical"},
              {"criterion": "[[ok:Score: 0]] b", "severity": "minor"}]
  minor_met = [{"criterion": "[[ok:Score: 0]] a", "severity": "critical"},
               {"criterion": "[[ok:Score: 1]] b", "severity": "minor"}]
  hi = rewards.rubicap_reward("D", "c", rubrics=crit_met, judge=judge, mode="text").value
  lo = rewards.rubicap_reward("D", "c", rubrics=minor_met, judge=judge, mode="text").value
  assert (hi, lo) == (pytest.approx(3 / 4), pytest.approx(1 / 4))


def test_self_praise_and_length_monitor_reach_the_batch_metrics():
  praise = ["A cake on a table. This description is absolutely correct and complete.",
            "A cake. This detailed description should provide everything a text model needs.",
            "A carrot cake with white icing that reads 24 CARROT CAKE on a wooden table."]
  monitors = [rewards.caption_monitor(c) for c in praise]
  assert [m["self_praise"] for m in monitors] == [1.0, 1.0, 0.0]
  assert [m["words"] for m in monitors] == [12.0, 12.0, 15.0]
  batch = rewards.RewardBatch((0, 1, 2), np.zeros(3, np.float32), tuple({"monitor": m} for m in monitors), ())
  metrics = batch.metrics()
  assert metrics["reward/monitor/self_praise"] == pytest.approx(2 / 3)
  assert metrics["reward/monitor/words"] == pytest.approx(39 / 3)
