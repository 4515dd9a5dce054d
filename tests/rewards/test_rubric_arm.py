"""Rubric-ARM's rewards on hand-built cases (shared/seeds/004): the judge's R_acc + w·R_fmt and the
generator's frozen-judge correctness, averaged over both orders."""

import pytest

from jaxrl import data, rewards
from jaxrl.rl._rubric_arm import arithmetic_pairs

TEMPLATE = "{rubric}|{question}|A:{a}|B:{b}"


@pytest.mark.parametrize("text,verdict_ok,fmt", [
    ("criterion 1 met by A. [[A]]", True, True),   # right verdict, right format
    ("[[A]]", True, False),                         # no justification
    ("A", True, False),                             # a lone letter: a verdict, not the format
    ("B is worse. [[A]] [[B]]", False, False),     # two verdicts: the last one counts, format broken
    ("both fine. [[B]]", False, True),              # wrong verdict, right format
    ("no idea", False, False),                      # no verdict
])
def test_judge_reward_is_accuracy_plus_weighted_format(text, verdict_ok, fmt):
  got = rewards.rubric_arm_judge_reward("p", text, label="A", format_weight=0.25)
  assert got.value == float(verdict_ok) + 0.25 * float(fmt)
  assert rewards.judge_format_ok(text) == fmt


def test_judge_reward_rejects_a_bad_label():
  with pytest.raises(ValueError, match="label must be 'A' or 'B'"):
    rewards.rubric_arm_judge_reward("p", "x [[A]]", label="C")


def _scripted_judge(prompts):
  """Prefers the response that contains the rubric's keyword, else always says A (position bias)."""
  outs = []
  for p in prompts:
    rubric, _, a, b = p.split("|")
    key = rubric.removeprefix("must contain ")
    if rubric.startswith("must contain ") and (key in a) != (key in b):
      outs.append("check. [[A]]" if key in a else "check. [[B]]")
    else:
      outs.append("A")
  return outs


@pytest.mark.parametrize("rubric,orders,expected", [
    ("must contain 14", "both", 1.0),        # discriminative rubric: right in both orders
    ("must contain 21", "both", 0.0),        # points at the wrong answer: wrong in both orders
    ("be nice", "both", 0.5),                # useless rubric: the judge's position bias is right once
    ("be nice", "chosen_first", 1.0),        # one order only: position bias pays (why "both" is the default)
])
def test_generator_reward_is_frozen_judge_correctness(rubric, orders, expected):
  seen = []
  judge_fn = lambda prompts: (seen.extend(prompts), _scripted_judge(prompts))[1]
  got = rewards.rubric_arm_generator_reward("rubric prompt", rubric, question="8+6=?", chosen="8+6=14. Answer: 14",
                                            rejected="8+6=21. Answer: 21", judge_fn=judge_fn, template=TEMPLATE,
                                            orders=orders)
  assert got.value == expected
  first = TEMPLATE.format(rubric=rubric, question="8+6=?", a="8+6=14. Answer: 14", b="8+6=21. Answer: 21")
  swapped = TEMPLATE.format(rubric=rubric, question="8+6=?", a="8+6=21. Answer: 21", b="8+6=14. Answer: 14")
  assert seen == ([first, swapped] if orders == "both" else [first])


def test_arithmetic_pairs_prefer_the_correct_answer():
  task = data.BuiltinTask(n_train=40, difficulty=3, seed=5)
  for pair, rec in zip(arithmetic_pairs(task, seed=1), task.records("train")):
    assert data.exact_match(pair["chosen"], rec["answer"]) and not data.exact_match(pair["rejected"], rec["answer"])
    assert data.extract_answer(pair["rejected"]) is not None and pair["prompt"] == rec["messages"][0]["content"]


@pytest.mark.parametrize("override,key", [
    ("format_weight=1.0", "format_weight must be in [0, 1)"),
    ("generator.reward.fn=math", "generator.reward.fn/kwargs: set by Rubric-ARM"),
    ("judge_template='{rubric} {answer}'", "judge_template: uses a field other than"),
    ("judge.reward.runner.executor=process", "judge.reward.runner.executor: must be 'thread'"),
    ("rounds=0", "rounds must be >= 1"),
    ("judge_sft={out_dir: x}", "judge_sft.out_dir: set by Rubric-ARM"),
])
def test_rubric_arm_config_errors_name_the_key(override, key, capsys):
  from pathlib import Path

  from jaxrl.cli.rubric_arm import main
  config = Path(__file__).resolve().parents[2] / "configs" / "rubric_arm_tiny.yaml"
  assert main(["--config", str(config), override]) == 2
  assert key in capsys.readouterr().err
