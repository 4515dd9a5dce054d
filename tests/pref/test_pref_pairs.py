"""The ``mixed`` arithmetic preference pairs, checked by an independent reading of the worked answers."""

from __future__ import annotations

import re

import pytest

from jaxrl import data as data_lib
from jaxrl import pref

STEP = re.compile(r"^(-?\d+)([+\-*])(-?\d+)=(-?\d+)$")


def _read(prompt, answer):
  """``(operands used, number of steps whose arithmetic is wrong, final answer)`` of a worked answer, read
  with a regex and Python arithmetic; the operands are the ones taken from the question (not step results)."""
  body, final = answer.rsplit(". Answer: ", 1)
  wrong, used = 0, []
  results = []
  for step in body.split("; "):
    a, op, b, got = STEP.match(step).groups()
    a, b, got = int(a), int(b), int(got)
    want = a * b if op == "*" else a + b if op == "+" else a - b
    wrong += want != got
    used += [x for x in (a, b) if x not in results or results.remove(x)]
    results.append(got)
  return used, wrong, int(final)


def test_mixed_pairs_have_both_error_kinds_and_a_wrong_final_answer():
  task = data_lib.ArithmeticConfig.level(2)
  records = pref.arithmetic_pairs(200, split="train", seed=5, task=task, rejected="mixed")
  kinds = {"slip": 0, "operand": 0}
  for r in records:
    numbers = sorted(int(x) for x in re.findall(r"\d+", r["prompt"]))
    c_used, c_wrong, c_final = _read(r["prompt"], r["chosen"])
    assert c_wrong == 0 and str(c_final) == r["answer"]
    used, wrong, final = _read(r["prompt"], r["rejected"])
    assert final != c_final, r
    assert body_consistent(r["rejected"]), r
    if wrong:
      assert wrong == 1 and sorted(abs(u) for u in used) == numbers, r  # right question, one slipped step
      kinds["slip"] += 1
    else:
      assert sorted(abs(u) for u in used) != numbers, r  # right arithmetic on a moved operand
      kinds["operand"] += 1
  assert 70 <= kinds["slip"] <= 130 and kinds["slip"] + kinds["operand"] == 200, kinds


def body_consistent(answer):
  """The stated final answer is the last step's result."""
  body, final = answer.rsplit(". Answer: ", 1)
  return body.rsplit("=", 1)[1] == final


def test_operand_pairs_are_unchanged_and_held_out_questions_are_disjoint():
  task = data_lib.ArithmeticConfig.level(2)
  old = pref.arithmetic_pairs(50, split="train", seed=1, task=task)
  assert old == pref.arithmetic_pairs(50, split="train", seed=1, task=task, rejected="operand")
  assert all(_read(r["prompt"], r["rejected"])[2] != int(r["answer"]) for r in old)
  train = {r["prompt"] for r in pref.arithmetic_pairs(500, split="train", seed=1, task=task, rejected="mixed")}
  held = {r["prompt"] for r in pref.arithmetic_pairs(64, split="heldout", seed=1, task=task, rejected="mixed")}
  assert len(held) == 64 and not train & held
  with pytest.raises(ValueError, match="rejected must be one of"):
    pref.arithmetic_pairs(2, split="train", seed=1, task=task, rejected="typo")


def _record(line, samples):
  """A ``jaxrl eval`` record of ``(response, correct, finish reason)`` samples."""
  texts, correct, reasons = zip(*samples)
  return {"line": line, "responses": list(texts), "correct": list(correct), "finish_reasons": list(reasons)}


def test_sampled_pairs_pair_a_correct_sample_with_distinct_wrong_ones_of_the_same_question():
  problems = [{"prompt": f"{i}+1=?", "answer": str(i + 1)} for i in range(4)]
  right = [f"{i}+1={i + 1}. Answer: {i + 1}" for i in range(4)]
  records = [
      _record(1, [(right[0], True, "eos"), ("0+1=2. Answer: 2", False, "eos"), ("0+1=2. Answer: 2", False, "eos"),
                  ("0+1=3. Answer: 3", False, "length")]),
      _record(2, [(right[1], True, "eos"), (right[1], True, "eos")]),  # no wrong sample: no pair
      _record(3, [("2+1=4. Answer: 4", False, "eos")]),  # no correct sample: no pair
      _record(4, [(right[3], True, "length"), ("3+1=5. Answer: 5", False, "eos")]),  # the correct one is cut off
  ]
  pairs = pref.sampled_pairs(problems, records, seed=0, per_prompt=3)
  assert sorted(p["rejected"] for p in pairs) == ["0+1=2. Answer: 2", "0+1=3. Answer: 3"]  # deduplicated
  assert all(p["prompt"] == "0+1=?" and p["chosen"] == right[0] and p["answer"] == "1" for p in pairs)
  assert len(pref.sampled_pairs(problems, records, seed=0, per_prompt=1)) == 1
  with pytest.raises(ValueError, match="line 9 is not one of the 4 problems"):
    pref.sampled_pairs(problems, [_record(9, [("x", True, "eos")])], seed=0)
  with pytest.raises(ValueError, match="has no responses"):
    pref.sampled_pairs(problems, [{"line": 1, "correct": [True]}], seed=0)
