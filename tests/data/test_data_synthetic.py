"""Built-in arithmetic task: worked answers, determinism, disjoint splits, answer checking."""

import json

import pytest

from jaxrl.data import (
    ArithmeticConfig,
    exact_match,
    extract_answer,
    generate_arithmetic,
    reasoning_gym_records,
    solve,
    write_arithmetic_splits,
)


def test_solve_does_multiplication_first_with_steps():
  assert solve([3, 4, 2], ["+", "*"]) == (["4*2=8", "3+8=11"], 11)
  assert solve([9, 5, 3, 2], ["-", "*", "+"]) == (["5*3=15", "9-15=-6", "-6+2=-4"], -4)


def test_easiest_level_is_one_digit_addition():
  records = generate_arithmetic(200, seed=0)
  for r in records:
    (user, assistant) = r["messages"]
    a, b = user["content"].removesuffix("=?").split("+")
    assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    assert assistant["content"] == f"{a}+{b}={int(a) + int(b)}. Answer: {int(a) + int(b)}"
    assert r["answer"] == str(int(a) + int(b))


def test_generation_is_deterministic_in_seed():
  cfg = ArithmeticConfig.level(3)
  assert generate_arithmetic(50, seed=7, config=cfg) == generate_arithmetic(50, seed=7, config=cfg)
  assert generate_arithmetic(50, seed=7, config=cfg) != generate_arithmetic(50, seed=8, config=cfg)


@pytest.mark.parametrize("level", [0, 2, 4])
def test_train_and_heldout_questions_never_overlap(level):
  cfg = ArithmeticConfig.level(level)
  train = generate_arithmetic(2000, seed=0, config=cfg)
  heldout = generate_arithmetic(10 if level == 0 else 200, seed=1, split="heldout", config=cfg,
                                unique=True)
  questions = lambda rs: {r["messages"][0]["content"] for r in rs}  # noqa: E731
  assert not questions(train) & questions(heldout)
  assert len(questions(heldout)) == len(heldout)


def test_multi_turn_variant_chains_answers():
  cfg = ArithmeticConfig.level(1, num_turns=3)
  for r in generate_arithmetic(20, seed=0, config=cfg):
    roles = [m["role"] for m in r["messages"]]
    assert roles == ["user", "assistant"] * 3
    answers = [extract_answer(m["content"]) for m in r["messages"][1::2]]
    for prev, user, reply in zip(answers, r["messages"][2::2], r["messages"][3::2]):
      assert user["content"].startswith("Then ")
      assert reply["content"].startswith(prev)
    assert answers[-1] == r["answer"]


def test_prompt_completion_variant_and_answer_checks():
  (r,) = generate_arithmetic(1, seed=3, format="prompt_completion", config=ArithmeticConfig.level(2))
  assert set(r) == {"prompt", "completion", "answer"}
  assert exact_match(r["completion"], r["answer"])
  assert not exact_match(r["completion"].replace(f"Answer: {r['answer']}", "Answer: 99999"), r["answer"])
  assert extract_answer("no answer here") is None
  assert extract_answer("2+2=4. Answer: 4 ... Answer: -5") == "-5"
  assert exact_match("Answer: 12", 12)


def test_write_splits_writes_jsonl(tmp_path):
  paths = write_arithmetic_splits(tmp_path, n_train=30, n_heldout=5, seed=0)
  train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
  heldout = [json.loads(line) for line in paths["heldout"].read_text().splitlines()]
  assert len(train) == 30 and len(heldout) == 5


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="ops"):
    ArithmeticConfig(ops=("/",))
  with pytest.raises(ValueError, match="max_terms"):
    ArithmeticConfig(min_terms=3, max_terms=2)
  with pytest.raises(ValueError, match="num_turns=1"):
    generate_arithmetic(1, seed=0, format="prompt_completion", config=ArithmeticConfig(num_turns=2))
  with pytest.raises(ValueError, match="could only draw"):
    generate_arithmetic(50, seed=0, split="heldout", unique=True)  # level 0 has ~10 held-out sums


def test_reasoning_gym_source_is_optional():
  try:
    import reasoning_gym  # noqa: F401
  except ImportError:
    with pytest.raises(ImportError, match="reasoning-gym"):
      reasoning_gym_records("basic_arithmetic", 2, seed=0)
  else:
    assert len(reasoning_gym_records("basic_arithmetic", 2, seed=0)) == 2
