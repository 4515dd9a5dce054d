"""Format checks and reward combinators (weighted sum, gate, ARPO hierarchical)."""

import pickle

import pytest

from jaxrl.rewards import (
  FormatConfig,
  check_format,
  format_reward,
  gate,
  hierarchical_reward,
  load_reward,
  weighted_sum,
)


@pytest.mark.parametrize("completion, reason", [
  ("<think>because</think> 42", "ok"),
  ("  <think>\nmulti\nline\n</think>\n\nThe answer is 42", "ok"),
  ("42", "missing_open_tag"),
  ("preamble <think>x</think> 42", "missing_open_tag"),
  ("<think>never closed 42", "missing_close_tag"),
  ("<think>a</think><think>b</think> 42", "multiple_think_blocks"),
  ("<think>all thought, no answer</think>   ", "bad_answer"),
])
def test_check_format_reasons(completion, reason):
  assert check_format("Q", completion).reason == reason


def test_check_format_splits_thinking_and_answer():
  c = check_format("Q", "<think>step</think> final")
  assert (c.thinking, c.answer.strip()) == ("step", "final")


def test_prompt_opened_think_is_detected():
  assert check_format("... <think>\n", "reasoning</think> 4").passed
  assert check_format("... <think>\n", "<think>reasoning</think> 4").passed
  assert not check_format("plain prompt", "reasoning</think> 4").passed


def test_r1_preset_requires_answer_tags():
  cfg = FormatConfig.r1()
  assert check_format("Q", "<think>x</think> <answer>4</answer>", cfg).passed
  assert check_format("Q", "<think>x</think> 4", cfg).reason == "bad_answer"


def test_custom_full_pattern_replaces_tag_rules():
  cfg = FormatConfig(pattern=r"\s*<reasoning>.+</reasoning>\s*\S.*")
  assert check_format("Q", "<reasoning>r</reasoning> 4", cfg).passed
  assert check_format("Q", "<think>r</think> 4", cfg).reason == "pattern_mismatch"


def test_format_reward_values_configurable():
  cfg = FormatConfig(pass_value=0.5, fail_value=-1.0)
  assert format_reward("Q", "<think>x</think> y", config=cfg).value == 0.5
  r = format_reward("Q", "y", config=cfg)
  assert r.value == -1.0 and r.info == {"passed": False, "reason": "format:missing_open_tag"}


def test_format_config_rejects_bad_regex():
  with pytest.raises(ValueError, match="answer_pattern"):
    FormatConfig(answer_pattern="(")


def test_weighted_sum_adds_weighted_components():
  fn = weighted_sum({"format": "format", "math": "math"}, {"format": 0.1})
  r = fn("Q", r"<think>x</think> \boxed{4}", answer="4")
  assert r.value == pytest.approx(1.1)
  assert r.info["components"] == {"format": 1.0, "math": 1.0}
  assert fn("Q", r"\boxed{4}", answer="4").value == 0.0


def test_weighted_sum_rejects_weights_for_unknown_components():
  with pytest.raises(ValueError, match="weights"):
    weighted_sum({"format": "format"}, {"math": 1.0})


def test_gate_returns_correctness_only_when_format_passes():
  fn = gate("format", load_reward("math", config={"require_think": False}), fail_value=-1.0)
  assert fn("Q", r"<think>x</think> \boxed{4}", answer="4").value == 1.0
  assert fn("Q", r"<think>x</think> \boxed{5}", answer="4").value == 0.0
  r = fn("Q", r"\boxed{4}", answer="4")
  assert r.value == -1.0 and r.info["gate"] is False and r.info["reason"] == "format:missing_open_tag"


def _always_half(prompt, completion, **_):
  return 0.5


def test_gate_uses_threshold_when_check_has_no_passed_flag():
  assert gate(_always_half, _always_half, threshold=0.6)("Q", "c").value == 0.0
  assert gate(_always_half, _always_half, threshold=0.5)("Q", "c").value == 0.5


def _exact(prompt, completion, *, answer, **_):
  return 1.0 if completion.rstrip().endswith(answer) else 0.0


@pytest.mark.parametrize("completion, expected", [
  ("<think><search>q</search><python>1+1</python></think> 2", 1.1),  # correct + both tools
  ("<think><search>q</search></think> 2", 1.0),                      # correct, one tool
  ("<think><search>q</search><python>x</python></think> 3", 0.0),    # wrong: no bonus
  ("<search>q</search><python>x</python> 2", -1.0),                  # bad format
])
def test_hierarchical_reward_matches_arpo_cases(completion, expected):
  fn = hierarchical_reward("format", _exact)
  assert fn("Q", completion, answer="2").value == pytest.approx(expected)


def test_combinators_pickle_for_process_workers():
  fn = gate("format", weighted_sum({"m": "math"}))
  again = pickle.loads(pickle.dumps(fn))
  assert again("Q", r"<think>x</think> \boxed{4}", answer="4").value == 1.0
