"""Vision-R1's hard formatting result reward: 1 only for a valid format *and* a correct answer."""

import pytest

from jaxrl import rewards

# (completion, answer, format_ok, answer_ok): hand-labelled from the notes' definition.
CASES = [
  ("<think>3 + 4 = 7</think> \\boxed{7}", "7", True, True),
  ("<think>half of 1</think> The answer is $\\frac{1}{2}$.", "0.5", True, True),
  ("\\boxed{7}", "7", False, True),                             # right answer, no reasoning block
  ("<think>7</think> \\boxed{8}", "7", True, False),            # format fine, wrong answer
  ("<think>the answer is 7</think> I am not sure.", "7", True, False),  # 7 only in the reasoning
  ("<think>3+4</think>", "7", False, True),                     # nothing after </think>
  ("<think>a</think><think>b</think> 7", "7", False, True),     # two reasoning blocks
  ("<think>   </think> \\boxed{7}", "7", False, True),          # empty reasoning
  ("Let me think. 7 </think> \\boxed{7}", "7", False, True),     # no opening tag
  ("<think>no close tag \\boxed{7}", "7", False, True),
]


@pytest.mark.parametrize("completion,answer,fmt,ans", CASES)
def test_hard_rule_is_the_product_of_format_and_result(completion, answer, fmt, ans):
  r = rewards.hard_format_reward("Q", completion, answer=answer)
  assert r.value == float(fmt and ans)
  assert r.info["format_ok"] is fmt
  if fmt:
    assert r.info["answer_ok"] is ans
    assert r.info["reason"] == "correct" if ans else r.info["reason"] in ("wrong_answer", "no_answer")
  else:
    assert r.info["reason"].startswith("format:") and r.info["answer_ok"] is None


def test_each_half_alone_would_disagree_with_the_hard_rule():
  """Dropping either half of the rule changes the reward on some hand case: the format-only and the
  result-only rewards both pay 1 where the hard rule pays 0."""
  hard = [rewards.hard_format_reward("Q", c, answer=a).value for c, a, *_ in CASES]
  fmt_only = [rewards.format_reward("Q", c).value for c, *_ in CASES]
  result_only = [rewards.math_reward("Q", c, answer=a, config={"require_think": False}).value for c, a, *_ in CASES]
  assert any(f == 1.0 and h == 0.0 for f, h in zip(fmt_only, hard))
  assert any(r == 1.0 and h == 0.0 for r, h in zip(result_only, hard))
  assert hard == [float(f and a) for _, _, f, a in CASES]


def test_answer_tags_and_prompt_opened_think():
  r1 = {"think": {"answer_pattern": "<answer>.+?</answer>"}}
  assert rewards.hard_format_reward("Q", "<think>a</think><answer>\\frac{1}{2}</answer>", answer="0.5",
                                    config=r1).value == 1.0
  assert rewards.hard_format_reward("Q", "<think>a</think> \\boxed{3}", answer="3", config=r1).info["reason"] == \
    "format:bad_answer"
  # R1-distill templates end the prompt with <think>: the completion holds only "... </think> answer".
  assert rewards.hard_format_reward("Q <think>", "3 + 4</think> \\boxed{7}", answer="7").value == 1.0
  assert rewards.load_reward("hard_format")("Q", "<think>x</think> 2", answer="2").value == 1.0
  assert rewards.hard_format_reward("Q", "<think>x</think> 2", answer="2",
                                    config={"correct_value": 5.0, "fail_value": -1.0}).value == 5.0
