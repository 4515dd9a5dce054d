"""reasoning-gym datasets and their verifiers."""

import pytest

from jaxrl.rewards import RewardRunner, reasoning_gym_dataset, reasoning_gym_reward

pytest.importorskip("reasoning_gym", reason="the reasoning-gym package is not installed")


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_dataset_records_are_deterministic_in_seed(name):
  a = reasoning_gym_dataset(name, size=5, seed=3)
  b = reasoning_gym_dataset(name, size=5, seed=3)
  c = reasoning_gym_dataset(name, size=5, seed=4)
  assert a == b and a != c
  assert set(a[0]) == {"prompt", "system", "answer", "metadata", "dataset"}
  assert a[0]["metadata"]["source_dataset"] == name and "<answer>" in a[0]["system"]


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_reference_answers_score_one_and_wrong_ones_zero(name):
  for rec in reasoning_gym_dataset(name, size=8, seed=0):
    fields = {"answer": rec["answer"], "metadata": rec["metadata"]}
    good = reasoning_gym_reward(rec["prompt"], f"<think>...</think><answer>{rec['answer']}</answer>", **fields)
    bad = reasoning_gym_reward(rec["prompt"], f"<answer>{int(rec['answer']) + 1}</answer>", **fields)
    assert (good.value, bad.value) == (1.0, 0.0)


def test_missing_answer_tag_scores_zero_and_boxed_fallback():
  rec = reasoning_gym_dataset("chain_sum", size=1, seed=0)[0]
  fields = {"answer": rec["answer"], "metadata": rec["metadata"]}
  assert reasoning_gym_reward("", f"it is {rec['answer']}", **fields).info["reason"] == "no_answer"
  assert reasoning_gym_reward("", f"\\boxed{{{rec['answer']}}}", **fields).value == 1.0
  strict = {"boxed_fallback": False}
  assert reasoning_gym_reward("", f"\\boxed{{{rec['answer']}}}", config=strict, **fields).value == 0.0


def test_require_think_applies_the_format_check():
  rec = reasoning_gym_dataset("chain_sum", size=1, seed=0)[0]
  fields = {"answer": rec["answer"], "metadata": rec["metadata"], "config": {"require_think": True}}
  r = reasoning_gym_reward("", f"<answer>{rec['answer']}</answer>", **fields)
  assert r.info["reason"] == "format:missing_open_tag"


def test_runner_scores_reasoning_gym_batch_by_short_name():
  recs = reasoning_gym_dataset("chain_sum", size=4, seed=1)
  with RewardRunner("reasoning_gym") as runner:
    batch = runner.score([r["prompt"] for r in recs], [f"<answer>{r['answer']}</answer>" for r in recs],
                         answer=[r["answer"] for r in recs], metadata=[r["metadata"] for r in recs])
  assert batch.rewards.tolist() == [1.0] * 4
