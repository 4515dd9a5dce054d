"""Problem files as public benchmarks ship them, and the built-in scorers of ``jaxrl eval``."""

import json
from pathlib import Path

import pytest

from jaxrl import data as data_lib
from jaxrl import eval as ev
from jaxrl import models

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3"


@pytest.fixture(scope="module")
def tokenizer():
  return models.load_tokenizer(MODEL)


def test_aime_style_columns_are_mapped_and_templated(tmp_path, tokenizer):
  path = tmp_path / "aime.jsonl"
  rows = [{"ID": "2024-I-1", "Problem": "find x.", "Answer": 204},
          {"ID": "2024-I-2", "Problem": "find y.", "Answer": 25}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  template = "{prompt} put the final answer in a box."
  got = ev.load_problems(path, tokenizer, max_prompt_tokens=256, prompt_field="Problem", answer_field="Answer",
                         template=template, required=("answer",))
  assert [ev.problem_id(r) for r in got.records] == ["2024-I-1", "2024-I-2"]
  assert [r["answer"] for r in got.records] == [204, 25]
  want = data_lib.encode_prompt(tokenizer, {"prompt": "find x. put the final answer in a box."})
  assert got.ids[0].tolist() == want.tolist()  # the chat template, as the RL trainer renders a prompt
  assert "find x. put the final answer in a box." in got.texts[0]


def test_problem_file_errors_name_file_and_line(tmp_path, tokenizer):
  path = tmp_path / "p.jsonl"
  path.write_text('{"problem": "a", "answer": 1}\n{"question": "b", "answer": 2}\n', encoding="utf-8")
  with pytest.raises(data_lib.DataError, match=f"{path}:2: needs a text field 'problem'"):
    ev.load_problems(path, tokenizer, max_prompt_tokens=64, prompt_field="problem")
  with pytest.raises(data_lib.DataError, match=f"{path}:1: record needs 'prompt' or 'messages'"):
    ev.load_problems(path, tokenizer, max_prompt_tokens=64)


def test_over_long_prompts_are_skipped_and_counted(tmp_path, tokenizer):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "word " * 200, "answer": 1}) + "\n" + json.dumps({"prompt": "hi", "answer": 2})
                  + "\n", encoding="utf-8")
  got = ev.load_problems(path, tokenizer, max_prompt_tokens=64)
  assert got.skipped == 1 and [r["answer"] for r in got.records] == [2]


def test_code_scorer_runs_the_tests_in_the_sandbox():
  tests = [{"input": "3\n", "output": "6\n"}, {"input": "5\n", "output": "10\n"}]
  with ev.make_scorer("code") as scorer:
    idx = [scorer.submit("Q", "```python\nprint(int(input()) * 2)\n```", tests=tests),
           scorer.submit("Q", "```python\nprint(6)\n```", tests=tests),
           scorer.submit("Q", "no code", tests=tests)]
    batch = scorer.collect(idx)
  assert batch.rewards.tolist() == [1.0, 0.0, 0.0]
  assert batch.infos[2]["reason"] == "no_code"


def test_custom_task_needs_a_reward_and_unknown_tasks_are_refused():
  with pytest.raises(ValueError, match="--reward"):
    ev.make_scorer("custom")
  with pytest.raises(ValueError, match="task must be one of"):
    ev.make_scorer("chess")
