"""CapRL's caption-utility reward (shared/seeds/004, CapRL "Reward 设计"; the authors' reward code).

A text-only answerer LLM that never sees the image answers the image's multiple-choice questions from the
policy's caption alone. For each of N rounds every question's options, with an extra "cannot be answered
from the description" option, are shuffled (seeded per question and round), relettered A, B, ...; the
first option letter in the answer is taken; exact match against the correct option's new letter. The
reward is the accuracy averaged over the questions and the rounds:

    r(caption) = 1/(Q·N) · Σ_q Σ_n 1[first_letter(answer_{q,n}) = letter_{q,n}(correct_q)]

Shuffling removes the answerer's option-position bias (N = 4 saturates in the paper); the extra option gives
a caption that lacks the fact somewhere to send the answerer other than a lucky guess. The answerer samples
at ``temperature`` 0.6 with a few tokens (the authors' settings). QA curation (`question_accuracy` with and
without the image) lives in `jaxrl.eval` (``jaxrl caprl-curate``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import re
import string
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.rewards._answerer import as_chat
from jaxrl.rewards._base import RewardResult, as_config

__all__ = ["CapRLConfig", "MCQuestion", "caprl_reward", "first_option_letter", "parse_questions",
           "question_accuracy", "shuffled_options"]

CAPTION_TEMPLATE = ("Answer the multiple-choice question about an image. You cannot see the image; use only its "
                    "description.\n\nDescription:\n{caption}\n\nQuestion: {question}\nOptions:\n{options}\n\n"
                    "Reply with the letter of one option.")
CAPRL_QUESTION_TEMPLATE = "Question: {question}\nOptions:\n{options}\n\nReply with the letter of one option."


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapRLConfig:
  """Rounds, shuffling and sampling of the answerer."""

  rounds: int = 4
  """N: sampling rounds per question, each with its own option order."""
  temperature: float = 0.6
  max_tokens: int = 8
  seed: int = 0
  """Base seed of the option shuffles and of the answerer's sampling."""
  add_unanswerable: bool = True
  """Add `unanswerable` to the options before shuffling (the authors' code)."""
  unanswerable: str = "The question cannot be answered from the description."
  max_questions: int | None = None
  """Use only the first k questions of an image (the paper: one already gives most of the gain); None: all."""
  template: str = CAPTION_TEMPLATE
  """Formatted with ``caption``, ``question`` and ``options`` (lines ``A. text``)."""

  def __post_init__(self):
    if self.rounds < 1:
      raise ValueError(f"rounds: must be >= 1, got {self.rounds!r}")
    if self.max_tokens < 1 or self.temperature < 0:
      raise ValueError(f"max_tokens must be >= 1 and temperature >= 0, got {self.max_tokens!r}, {self.temperature!r}")
    if self.max_questions is not None and self.max_questions < 1:
      raise ValueError(f"max_questions: must be >= 1 or None, got {self.max_questions!r}")


@dataclasses.dataclass(frozen=True)
class MCQuestion:
  """A multiple-choice question; `answer` indexes `options`."""

  question: str
  options: tuple[str, ...]
  answer: int


def parse_questions(raw: Any, where: str = "questions") -> list[MCQuestion]:
  """Questions from a sample field: a list of ``{question, options, answer}`` where ``options`` is a list
  (lettered A, B, ... in order) or a ``{letter: text}`` dict and ``answer`` the correct letter.
  Raises ValueError naming `where` and the index of a malformed question."""
  if isinstance(raw, Mapping):
    raw = [raw]
  if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
    raise ValueError(f"{where}: expected a non-empty list of {{question, options, answer}}, got {raw!r:.80}")
  out = []
  for i, q in enumerate(raw):
    at = f"{where}[{i}]"
    if not isinstance(q, Mapping) or not isinstance(q.get("question"), str):
      raise ValueError(f"{at}: expected {{question, options, answer}}, got {q!r:.80}")
    opts = q.get("options")
    if isinstance(opts, Mapping):
      letters = sorted(opts)
      if letters != list(string.ascii_uppercase[:len(letters)]):
        raise ValueError(f"{at}.options: letters must be A, B, ... in sequence, got {letters}")
      opts = [opts[k] for k in letters]
    if not isinstance(opts, Sequence) or isinstance(opts, str) or len(opts) < 2 or len(opts) > 20:
      raise ValueError(f"{at}.options: expected 2 to 20 options, got {opts!r:.80}")
    if not all(isinstance(o, str) and o.strip() for o in opts) or len(set(opts)) != len(opts):
      raise ValueError(f"{at}.options: options must be distinct non-empty strings")
    ans = str(q.get("answer", "")).strip().upper()
    if len(ans) != 1 or not "A" <= ans < chr(ord("A") + len(opts)):
      raise ValueError(f"{at}.answer: expected one of the option letters A-{chr(ord('A') + len(opts) - 1)}, "
                       f"got {q.get('answer')!r}")
    out.append(MCQuestion(q["question"], tuple(opts), ord(ans) - ord("A")))
  return out


def shuffled_options(q: MCQuestion, *, seed: int, round_: int, unanswerable: str | None) -> tuple[list[str], int]:
  """The options of `q` in round `round_`'s order (with `unanswerable` added before shuffling) and the index
  of the correct one. The permutation is a function of (seed, question text, round) only."""
  opts = list(q.options) + ([unanswerable] if unanswerable else [])
  key = zlib.crc32(q.question.encode())
  perm = np.random.default_rng([seed, key, round_]).permutation(len(opts))
  return [opts[i] for i in perm], int(np.flatnonzero(perm == q.answer)[0])


def first_option_letter(text: str, n_options: int) -> str | None:
  """The first option letter standing alone in `text` (not inside a word): ``"(C) red"`` → C,
  ``"Answer: B"`` → B (the ``A`` of "Answer" is part of a word); None when there is none."""
  letters = string.ascii_uppercase[:n_options]
  m = re.search(rf"(?<![A-Za-z])([{letters}])(?![A-Za-z])", text)
  return m.group(1) if m else None


def _listing(options: Sequence[str]) -> str:
  return "\n".join(f"{string.ascii_uppercase[i]}. {o}" for i, o in enumerate(options))


def _concurrently(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
  """``[fn(x) for x in items]`` with the calls in flight together (threads): an answerer behind a server sees
  all of a caption's questions and rounds at once (its client bounds the requests in flight), not one at a
  time. The first exception propagates."""
  items = list(items)
  if len(items) < 2:
    return [fn(x) for x in items]
  with cf.ThreadPoolExecutor(len(items), thread_name_prefix="caprl") as pool:
    return list(pool.map(fn, items))


@dataclasses.dataclass(frozen=True)
class _Round:
  """One shuffled round of a question: the answerer's messages, its sampling seed, the options shown and the
  index of the correct one."""

  messages: list[dict[str, Any]]
  seed: int
  options: list[str]
  right: int


def _rounds(q: MCQuestion, *, prompt: str, cfg: CapRLConfig, image_part: Mapping | None,
            unanswerable: str | None) -> list[_Round]:
  out = []
  for n in range(cfg.rounds):
    opts, right = shuffled_options(q, seed=cfg.seed, round_=n, unanswerable=unanswerable)
    text = prompt.format(question=q.question, options=_listing(opts))
    content: Any = text if image_part is None else [dict(image_part), {"type": "text", "text": text}]
    out.append(_Round([{"role": "user", "content": content}], cfg.seed * 1_000_003 + n, opts, right))
  return out


def _ask(chat: Any, rounds: Sequence[_Round], cfg: CapRLConfig) -> list[str]:
  """The answerer's replies to `rounds`, all in flight together."""
  return _concurrently(lambda r: chat(r.messages, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                      seed=r.seed), rounds)


def _tally(rounds: Sequence[_Round], replies: Sequence[str], unanswerable: str | None) -> tuple[float, dict[str, int]]:
  counts = {"correct": 0, "unanswerable": 0, "no_letter": 0}
  for r, reply in zip(rounds, replies, strict=True):
    letter = first_option_letter(reply, len(r.options))
    if letter is None:
      counts["no_letter"] += 1
      continue
    idx = ord(letter) - ord("A")
    counts["correct"] += idx == r.right
    counts["unanswerable"] += unanswerable is not None and r.options[idx] == unanswerable
  return counts["correct"] / len(rounds), counts


def question_accuracy(chat: Any, q: MCQuestion, *, prompt: str, cfg: CapRLConfig, image_part: Mapping | None = None,
                      unanswerable: str | None = None) -> tuple[float, dict[str, int]]:
  """Accuracy of `chat` on `q` over ``cfg.rounds`` shuffled rounds. `prompt` is formatted with ``question``
  and ``options``; `image_part` (an OpenAI ``image_url`` part) goes before the text when given.
  Returns the accuracy and counts (``correct``, ``unanswerable``: chose the extra option, ``no_letter``)."""
  rounds = _rounds(q, prompt=prompt, cfg=cfg, image_part=image_part, unanswerable=unanswerable)
  return _tally(rounds, _ask(chat, rounds, cfg), unanswerable)


def caprl_reward(prompt: str, completion: str, *, questions: Any, answerer: Any = None,
                 config: CapRLConfig | dict | None = None, **_: Any) -> RewardResult:
  """CapRL: the answerer's exact-match accuracy on the image's `questions` from the caption `completion`,
  averaged over questions and ``config.rounds`` shuffled rounds (module docstring).

  ``answerer``: a judge config dict (any OpenAI-compatible server, `jaxrl serve`, ``judge.launch``), a
  `Judge`, an import path or a callable (`jaxrl.rewards.as_chat`). ``info``: ``per_question`` accuracies,
  ``unanswerable`` and ``no_letter`` counts over all rounds.
  """
  cfg = as_config(CapRLConfig, config, "config")
  qs = parse_questions(questions)
  if cfg.max_questions is not None:
    qs = qs[:cfg.max_questions]
  chat = as_chat(answerer)
  tmpl = cfg.template.replace("{caption}", completion.replace("{", "{{").replace("}", "}}"))
  per, totals = [], {"unanswerable": 0, "no_letter": 0}
  unanswerable = cfg.unanswerable if cfg.add_unanswerable else None
  rounds = [_rounds(q, prompt=tmpl, cfg=cfg, image_part=None, unanswerable=unanswerable) for q in qs]
  replies = iter(_ask(chat, [r for rs in rounds for r in rs], cfg))  # every question and round in one batch
  for rs in rounds:
    acc, counts = _tally(rs, [next(replies) for _ in rs], unanswerable)
    per.append(acc)
    for k in totals:
      totals[k] += counts[k]
  return RewardResult(value=float(np.mean(per)), info={"per_question": per, **totals})
