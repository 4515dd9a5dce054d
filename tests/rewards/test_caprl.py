"""CapRL's caption-utility reward: averaging over questions and shuffled rounds, the first-letter rule."""

import re

import numpy as np

import pytest
from judge_testlib import start_fake

from jaxrl import rewards

QUESTIONS = [
  {"question": "What colour is the ball?", "options": ["red", "blue", "green"], "answer": "A"},
  {"question": "How many dogs are there?", "options": {"A": "one", "B": "two", "C": "three"}, "answer": "C"},
]


def shown_options(messages):
  """The options as the answerer sees them, in order: [(letter, text)]."""
  text = messages[-1]["content"]
  text = text if isinstance(text, str) else text[-1]["text"]
  return re.findall(r"^([A-Z])\. (.*)$", text, flags=re.M)


def question_index(messages):
  """Which of QUESTIONS the prompt asks (-1: none of them)."""
  text = messages[-1]["content"]
  text = text if isinstance(text, str) else text[-1]["text"]
  return next((i for i, q in enumerate(QUESTIONS) if q["question"] in text), -1)


class Reader:
  """A scripted answerer that reads the caption: it answers the first shown option whose text is a word of
  the description, else the 'cannot be answered' option; so its answer depends on the option order."""

  def __init__(self):
    self._seen = []

  @property
  def seen(self):
    """The calls in question order (QUESTIONS), then round order (the seed): caprl_reward asks concurrently."""
    return sorted(self._seen, key=lambda call: (question_index(call[0]), call[3]))

  def __call__(self, messages, *, max_tokens=None, temperature=None, seed=None):
    self._seen.append((messages, max_tokens, temperature, seed))  # list.append is atomic under threads
    body = messages[-1]["content"]
    caption = body.split("Description:\n", 1)[1].split("\n\nQuestion:", 1)[0].lower().split()
    opts = shown_options(messages)
    for letter, text in opts:
      if text in caption:
        return f"({letter}) {text}"
    return next(f"{letter}." for letter, text in opts if text.startswith("The question cannot"))


def test_reward_averages_over_questions_and_shuffled_rounds():
  reader = Reader()
  r = rewards.caprl_reward("Describe the image.", "a red ball and a blue cup", questions=QUESTIONS, answerer=reader)
  assert len(reader.seen) == 2 * 4 and {s[1:3] for s in reader.seen} == {(8, 0.6)}
  # Hand count from what the answerer was shown: Q1 is right in a round iff "red" is listed before "blue";
  # Q2's answer ("three") is not in the caption, so the reader picks the extra option: always wrong.
  q1 = []
  for messages, *_ in reader.seen[:4]:
    order = [t for _, t in shown_options(messages)]
    assert len(order) == 4 and order[-1] != "" and "The question cannot be answered from the description." in order
    q1.append(order.index("red") < order.index("blue"))
  assert 0 < sum(q1) < 4, "seed 0 should show both orders in four rounds (else the test is weak)"
  want = (sum(q1) / 4 + 0.0) / 2
  assert r.value == pytest.approx(want)
  assert r.info["per_question"] == [sum(q1) / 4, 0.0]
  assert r.info["unanswerable"] == 4 and r.info["no_letter"] == 0
  # The option orders change between rounds and are seeded: the same seed shows the same prompts.
  assert len({tuple(shown_options(m)) for m, *_ in reader.seen[:4]}) > 1
  again = Reader()
  rewards.caprl_reward("p", "a red ball and a blue cup", questions=QUESTIONS, answerer=again)
  assert [m for m, *_ in again.seen] == [m for m, *_ in reader.seen]
  other = Reader()
  rewards.caprl_reward("p", "a red ball and a blue cup", questions=QUESTIONS, answerer=other, config={"seed": 1})
  assert [m for m, *_ in other.seen] != [m for m, *_ in reader.seen]


def test_unshuffled_single_round_and_a_complete_caption():
  reader = Reader()
  full = rewards.caprl_reward("p", "a red ball and three dogs", questions=QUESTIONS, answerer=reader,
                              config={"rounds": 3})
  assert full.value == 1.0 and len(reader.seen) == 6
  blind = lambda messages, **_: "A"  # noqa: E731  (always the first shown option)
  r = rewards.caprl_reward("p", "x", questions=QUESTIONS, answerer=blind, config={"rounds": 8, "seed": 3})
  firsts = []
  for q in rewards.parse_questions(QUESTIONS):
    firsts.append([rewards.shuffled_options(q, seed=3, round_=n, unanswerable=rewards.CapRLConfig().unanswerable)[1] == 0
                   for n in range(8)])
  assert r.value == pytest.approx(sum(map(sum, firsts)) / 16) and r.value < 1.0
  one = rewards.caprl_reward("p", "one red ball", questions=QUESTIONS, answerer=Reader(),
                             config={"max_questions": 1, "add_unanswerable": False, "rounds": 2})
  assert one.info["per_question"] == [1.0]


@pytest.mark.parametrize("text,want", [("C", "C"), ("(B) two", "B"), ("Answer: D", "D"), ("The answer is A.", "A"),
                                       ("B and C", "B"), ("Answer unclear", None), ("E", None), ("b", None),
                                       ("**C**", "C")])
def test_first_option_letter(text, want):
  assert rewards.first_option_letter(text, 4) == want


def test_no_letter_counts_as_wrong_and_bad_questions_name_the_index():
  r = rewards.caprl_reward("p", "c", questions=QUESTIONS, answerer=lambda m, **_: "I do not know")
  assert r.value == 0.0 and r.info["no_letter"] == 8
  with pytest.raises(ValueError, match=r"questions\[1\].answer"):
    rewards.parse_questions([QUESTIONS[0], {"question": "q", "options": ["a", "b"], "answer": "C"}])
  with pytest.raises(ValueError, match=r"questions\[0\].options"):
    rewards.parse_questions([{"question": "q", "options": ["a", "a"], "answer": "A"}])


def test_answers_through_an_openai_compatible_judge_with_a_seed_per_round():
  srv = start_fake()
  try:
    judge = {"base_url": srv.url, "max_retries": 0}
    r = rewards.caprl_reward("p", "[[ok:Answer: B]]", questions=QUESTIONS, answerer=judge)
    # the requests go out concurrently: sorted by question, then round (the seed)
    bodies = sorted(srv.server.config.app.state.bodies, key=lambda b: (question_index(b["messages"]), b["seed"]))
    assert len(bodies) == 8 and {b["temperature"] for b in bodies} == {0.6} and {b["max_tokens"] for b in bodies} == {8}
    assert len({b["seed"] for b in bodies[:4]}) == 4
    correct = ["red", "three"]
    right = [shown_options(b["messages"])[1][1] == correct[i] for i in range(2) for b in bodies[4 * i:4 * i + 4]]
    assert r.value == pytest.approx(sum(right) / 8)
  finally:
    srv.stop()


def reads_captions(messages, **_):
  """An import-path answerer for the runner test: the Reader's rule, stateless."""
  return Reader()(messages)


def test_runner_scores_caprl_by_name_with_an_import_path_answerer():
  runner = rewards.RewardRunner("caprl", reward_kwargs={"answerer": "test_caprl:reads_captions",
                                                         "config": {"rounds": 2, "add_unanswerable": True}})
  with runner:
    batch = runner.score(["p", "p"], ["a red ball and three dogs", "nothing useful"], questions=[QUESTIONS, QUESTIONS])
  np.testing.assert_allclose(batch.rewards, [1.0, 0.0])
  assert batch.infos[1]["unanswerable"] == 4 and not batch.errors
