"""Math answers: extraction, the equivalence table per backend, and the reward's values."""

import threading

import pytest

from jaxrl.rewards import (
  FormatConfig,
  MathRewardConfig,
  extract_answer,
  extract_boxed,
  is_equivalent,
  math_backends,
  math_reward,
  normalize_answer,
)

HAVE_MV = math_backends()["math_verify"] is not None
HAVE_SYMPY = math_backends()["sympy"] is not None

# (prediction, reference, python backend, math_verify backend, why)
TABLE = [
  ("1/2", "0.5", True, True, "a/b of integers evaluates to 0.5"),
  (r"\frac{1}{2}", "0.5", True, True, "fraction vs decimal, numerically"),
  (r"\dfrac12", r"\frac{1}{2}", True, True, r"\dfrac→\frac and \frac12→\frac{1}{2} in normalisation"),
  (r"\tfrac{1}{2}", "1/2", True, True, "same"),
  (r"\left(1, 2\right)", "(1,2)", True, True, r"\left/\right and spaces dropped"),
  ("5 cm", "5", True, True, "a known unit word after a number is dropped"),
  (r"5\text{ cm}", "5", True, True, r"\text unwrapped, then the unit"),
  ("3 apples.", "3", False, True, "'apples' is no unit we know; math-verify parses the leading number"),
  ("[1, 2)", "[1,2)", True, True, "same half-open interval"),
  ("[1,2)", "(1,2]", False, False, "different endpoints are open"),
  ("(1,2)", "(2,1)", False, False, "tuples are ordered"),
  (r"\{1,2\}", r"\{2,1\}", True, True, "sets are not"),
  ("x = 3", "3", True, True, "a one-letter 'x =' prefix is dropped"),
  ("y=-2", "-2", True, True, "same, negative"),
  (r"50\%", "50", True, True, "percent sign dropped (MATH convention)"),
  (r"50\%", "0.5", False, True, "math-verify reads 50% as 1/2; our normalisation does not"),
  ("1,000", "1000", True, True, "thousands separator in a plain number"),
  ("1{,}000", "1000", True, True, "LaTeX thousands separator"),
  ("1,000,000", "1000000", True, True, "several groups"),
  ("(1,234)", "1234", False, False, "a tuple is not a number with a separator"),
  ("3.", "3", True, True, "trailing period"),
  ("-2", "- 2", True, True, "spacing of a negative"),
  ("-2", "2", False, False, "sign matters"),
  (r"-\frac{1}{2}", "-0.5", True, True, "negative fraction"),
  (r"\frac{-1}{2}", "-1/2", True, True, "sign inside the numerator"),
  (r"\sqrt{2}", "2^{1/2}", True, True, "sqrt as a power"),
  (r"2\sqrt{2}", r"\sqrt{8}", True, True, "numeric evaluation"),
  (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}", True, True, "implicit product"),
  (r"\sqrt2", "1.41421356", False, True, "math-verify rounds to the shorter decimal; we compare at 1e-9"),
  (r"\pi", "3.14159", False, False, "pi is not 3.14159 (math-verify agrees)"),
  (r"2\pi", r"\pi*2", True, True, "pi products"),
  (r"\pi/2", r"\frac{\pi}{2}", True, True, "pi fraction"),
  ("0.333", "1/3", False, False, "a truncated decimal is wrong"),
  ("5", "5.0", True, True, "integer vs decimal"),
  (r"10^\circ", "10", True, True, "degree sign dropped"),
  (r"\$5", "5", True, True, "dollar sign dropped"),
  ("(B)", "B", True, True, "multiple-choice letter in parentheses"),
  (r"\text{B}", "B", True, True, r"\text unwrapped"),
  ("x^2+2x+1", "(x+1)^2", False, True, "symbolic: needs sympy or math-verify"),
  ("1e3", "1000", False, False, "scientific notation is not read"),
]
IDS = [f"{p} vs {g}" for p, g, *_ in TABLE]


@pytest.mark.parametrize("pred, gold, expected, why", [(p, g, py, w) for p, g, py, _, w in TABLE], ids=IDS)
def test_equivalence_table_python_backend(pred, gold, expected, why):
  assert is_equivalent(pred, gold, backend="python") is expected, why
  assert is_equivalent(gold, pred, backend="python") is expected, f"(swapped) {why}"


@pytest.mark.skipif(not HAVE_MV, reason="math-verify is not installed")
@pytest.mark.parametrize("pred, gold, expected, why", [(p, g, mv, w) for p, g, _, mv, w in TABLE], ids=IDS)
def test_equivalence_table_math_verify_backend(pred, gold, expected, why):
  assert is_equivalent(pred, gold, backend="math_verify") is expected, why


@pytest.mark.skipif(not HAVE_SYMPY, reason="sympy is not installed")
@pytest.mark.parametrize("pred, gold, expected", [
  ("x^2+2x+1", "(x+1)^2", True),
  (r"\frac{x}{2}", "0.5x", True),
  ("2x", "x+x", True),
  ("x^2", "x^3", False),
  (r"\sqrt{x^2}", "x", False),  # only for x >= 0
])
def test_sympy_backend_proves_symbolic_identities(pred, gold, expected):
  assert is_equivalent(pred, gold, backend="sympy") is expected


@pytest.mark.skipif(not HAVE_MV, reason="math-verify is not installed")
def test_math_verify_backend_works_off_the_main_thread():
  out = []
  t = threading.Thread(target=lambda: out.append(is_equivalent(r"50\%", "0.5", backend="math_verify")))
  t.start()
  t.join(30)
  assert out == [True]


def test_unknown_backend_is_an_error():
  with pytest.raises(ValueError, match="backend"):
    is_equivalent("1", "1", backend="wolfram")


@pytest.mark.parametrize("text, expected", [
  (r"so \boxed{42}.", "42"),
  (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
  (r"first \boxed{1} then \boxed{2}", "2"),
  (r"\fbox{7}", "7"),
  (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
  (r"\boxed 5 apples", "5"),
  (r"\boxed{unclosed", None),
  ("no box", None),
])
def test_extract_boxed_handles_nesting_and_variants(text, expected):
  assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
  (r"blah \boxed{3} Answer: 4", ("3", "boxed")),
  ("Work.\nAnswer: $\\frac{3}{4}$.", (r"\frac{3}{4}", "answer_line")),
  ("so the final answer is 12.", ("12", "answer_line")),
  ("**Answer:** 7", ("7", "answer_line")),
  ("we get 3 then 1,024 and -2.5", ("-2.5", "last_number")),
  ("ratio 3/4", ("3/4", "last_number")),
  ("I answered: see 9 below", ("9", "last_number")),
  ("nothing numeric", None),
])
def test_extract_answer_falls_back_in_order(text, expected):
  assert extract_answer(text) == expected


def test_normalize_answer_example():
  assert normalize_answer(r"x = \dfrac12 \text{ cm}.") == r"\frac{1}{2}"


def test_math_reward_default_is_deepscaler_binary():
  ok = "<think>1/2 is a half</think> The answer is \\boxed{\\dfrac12}."
  assert math_reward("Q", ok, answer="0.5").value == 1.0
  assert math_reward("Q", ok.replace("dfrac12", "dfrac13"), answer="0.5").value == 0.0


def test_math_reward_missing_think_gets_format_error_value():
  cfg = MathRewardConfig(format_error_value=-1.0)
  r = math_reward("Q", r"\boxed{2}", answer="2", config=cfg)
  assert r.value == -1.0 and r.info["reason"] == "format:missing_open_tag"
  r = math_reward("Q", r"<think>2 \boxed{2}", answer="2", config=cfg)
  assert r.info["reason"] == "format:missing_close_tag"


def test_math_reward_areal_preset_is_plus_minus_five():
  cfg = MathRewardConfig.areal()
  assert math_reward("Q", r"\boxed{2}", answer="2", config=cfg).value == 5.0
  assert math_reward("Q", r"\boxed{3}", answer="2", config=cfg).value == -5.0
  assert math_reward("Q", "no answer at all", answer="2", config=cfg).value == -5.0


def test_math_reward_reads_answer_after_think_only():
  text = r"<think>maybe \boxed{5}?</think> no, it is 6"
  r = math_reward("Q", text, answer="6")
  assert r.value == 1.0 and r.info["method"] == "last_number"


def test_math_reward_with_think_opened_by_the_prompt():
  prompt = "<|User|>1+1?<|Assistant|><think>\n"
  assert math_reward(prompt, r"one plus one</think> \boxed{2}", answer="2").value == 1.0
  strict = MathRewardConfig(think=FormatConfig(prompt_opens_think=False))
  assert math_reward(prompt, r"one plus one</think> \boxed{2}", answer="2", config=strict).value == 0.0


def test_math_reward_accepts_boxed_reference_and_alternatives():
  assert math_reward("Q", r"<think>.</think>\boxed{4}", answer=r"so \boxed{4}").value == 1.0
  assert math_reward("Q", r"<think>.</think>\boxed{-4}", answer=["4", "-4"]).value == 1.0


def test_math_reward_deepscaler_preset_needs_boxed():
  cfg = MathRewardConfig.deepscaler()
  r = math_reward("Q", "<think>.</think> Answer: 4", answer="4", config=cfg)
  assert r.value == 0.0 and r.info["reason"] == "no_answer"


def test_math_reward_refuses_overlong_answer_without_parsing():
  r = math_reward("Q", "<think>.</think>\\boxed{" + "1+" * 400 + "1}", answer="401")
  assert r.value == 0.0 and r.info["reason"] == "answer_too_long"


def test_math_reward_config_from_yaml_style_dict():
  r = math_reward("Q", r"\boxed{2}", answer="2", config={"require_think": False, "correct_value": 2.0})
  assert r.value == 2.0


@pytest.mark.parametrize("field, value", [("correct_value", float("inf")), ("extract", ("regex",)),
                                          ("backend", "maple"), ("max_answer_chars", 0)])
def test_math_config_validation_names_field(field, value):
  with pytest.raises(ValueError, match=field):
    MathRewardConfig(**{field: value})
