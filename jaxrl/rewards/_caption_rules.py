"""Rule-based stand-ins for CapRL's text answerer and RubiCap's rubric judge on the built-in caption task.

Both read only text, never the image: `scene_answerer` answers a CapRL question from the caption in the
prompt (`jaxrl.rewards.CAPTION_TEMPLATE`), `scene_rubric_check` checks one rubric of
`jaxrl.data.scene_rubrics` on a caption. They are what the tiny CPU recipes (configs/caprl_tiny.yaml,
configs/rubicap_tiny.yaml) score with: a text LLM that reads such captions reliably must itself be trained,
which does not fit a CPU session beside the policy, so the demo's answerer and judge are exact parsers of the
caption grammar (`jaxrl.data.parse_caption`). They behave as an ideal reader would: an answer the caption
does not settle goes to the "cannot be answered" option (CapRL) or fails the rubric (RubiCap); a caption
that misstates a fact gets the misstated answer. The LLM paths (``answerer`` / ``judge`` configs) are the
same reward functions with a model behind them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl import data as data_lib

__all__ = ["asked_about", "caption_answer", "read_question", "scene_answerer", "scene_rubric_check"]

_PROMPT_RE = re.compile(r"Description:\n(?P<caption>.*)\n\nQuestion: (?P<question>.*?)\nOptions:\n(?P<options>.*?)"
                        r"\n\n", re.S)
_OPTION_RE = re.compile(r"^([A-T])\. (.*)$")
_COLOR = "|".join(data_lib.COLORS)
_SHAPE = "|".join(data_lib.SHAPES)


def _count(facts: Mapping[str, Any], pred) -> str | None:
  return str(sum(pred(s) for s in facts["shapes"])) if facts["shapes"] else None


_QUESTIONS = (
  ("total", re.compile(r"How many (shape)s are in the image\?|How many (bar)s are in the chart\?")),
  ("colour_count", re.compile(rf"How many ({_COLOR}) shapes are in the image\?")),
  ("kind_count", re.compile(rf"How many ({_SHAPE})s are in the image\?")),
  ("side", re.compile(rf"Is the ({_COLOR}) ({_SHAPE}) on the left or on the right of the image\?")),
  ("bar_value", re.compile(rf"What is the value of the ({_COLOR}) bar\?")),
  ("tallest", re.compile(r"Which colour is the tallest bar\?")),
)


def read_question(question: str) -> tuple[str, tuple[str, ...]]:
  """Which of the caption task's questions (`jaxrl.data.scene_questions`) `question` is, and its words:
  ``("total", ("shape",))``, ``("colour_count", ("red",))``, ``("kind_count", ("circle",))``, ``("side", ("red",
  "square"))``, ``("bar_value", ("blue",))``, ``("tallest", ())``. Raises ValueError for another question."""
  q = question.strip()
  for kind, pattern in _QUESTIONS:
    if m := pattern.fullmatch(q):
      return kind, tuple(g for g in m.groups() if g is not None)
  raise ValueError(f"{question!r} is not a question of the built-in caption task")


def caption_answer(caption: str, question: str) -> str | None:
  """The answer the caption gives to one of the caption task's questions (`jaxrl.data.scene_questions`), as
  the option text (``"2"``, ``"left"``, ``"red"``), or None when the caption does not settle it. Raises
  ValueError for a question outside the task's set."""
  try:
    kind, words = read_question(question)
  except ValueError as e:
    raise ValueError(f"caption_answer: {e}") from None
  f = data_lib.parse_caption(caption)
  if kind == "total":
    items = f["bars"] if words == ("bar",) else f["shapes"]
    return str(f["total"]) if f["total"] is not None else (str(len(items)) if items else None)
  if kind == "colour_count":
    return _count(f, lambda s: s[0] == words[0])
  if kind == "kind_count":
    return _count(f, lambda s: s[1] == words[0])
  if kind == "side":
    sides = [s[2] for s in f["shapes"] if s[:2] == words]
    return sides[0] if sides else None
  if kind == "bar_value":
    values = [v for c, v in f["bars"] if c == words[0]]
    return str(values[0]) if values else None
  return max(f["bars"], key=lambda b: b[1])[0] if f["bars"] else None  # tallest


def asked_about(question: str) -> str:
  """The words of the caption a question turns on, as the caption writes them: the colour (``How many blue
  shapes``), the kind in the singular (``How many circles`` -> ``circle``), colour and kind (``Is the red square
  on the left or ...``), ``shapes`` / ``bars`` for the totals, the colour of a bar; ``""`` for the tallest bar.
  Raises ValueError for a question outside the task's set."""
  kind, words = read_question(question)
  return words[0] + "s" if kind == "total" else " ".join(words)


def scene_answerer(messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None = None,
                   temperature: float | None = None, seed: int | None = None) -> str:
  """A `jaxrl.rewards.ChatFn` answering CapRL's prompt (description, question, lettered options) by
  `caption_answer`: the letter of the option equal to the caption's answer; else the letter of the
  "cannot be answered" option (any option saying so) when offered; else ``"none"`` (no letter: scored wrong).
  Deterministic (``temperature`` and ``seed`` are accepted and unused). Raises ValueError for a prompt of
  another shape."""
  del max_tokens, temperature, seed
  text = messages[-1]["content"]
  m = _PROMPT_RE.search(text if isinstance(text, str) else "")
  if m is None:
    raise ValueError(f"scene_answerer: expected CapRL's prompt (Description/Question/Options), got {text!r:.80}")
  options = {}
  for line in m.group("options").splitlines():
    o = _OPTION_RE.match(line)
    if o is None:
      raise ValueError(f"scene_answerer: option line {line!r} is not 'L. text'")
    options[o.group(2)] = o.group(1)
  answer = caption_answer(m.group("caption"), m.group("question"))
  if answer in options:
    return options[answer]
  unanswerable = [letter for opt, letter in options.items() if "cannot be answered" in opt.lower()]
  return unanswerable[0] if unanswerable else "none"


def scene_rubric_check(criterion: str, caption: str) -> float:
  """1.0 if `caption` meets the rubric `criterion` (one of `jaxrl.data.scene_rubrics`' phrasings), else 0.0.
  Counts are of ``<colour> <kind>`` mentions, values of ``<colour> <value>`` mentions. Raises ValueError
  for a criterion of another phrasing."""
  f = data_lib.parse_caption(caption)
  c = criterion.strip()
  if m := re.fullmatch(r"The caption states that there are exactly (\d+) (shape|bar)s\.", c):
    return float(f["total"] == int(m.group(1)))
  if m := re.fullmatch(rf"The caption mentions exactly (\d+) ({_COLOR}) ({_SHAPE})s?\.", c):
    return float(sum(s[:2] == (m.group(2), m.group(3)) for s in f["shapes"]) == int(m.group(1)))
  if m := re.fullmatch(rf"The caption places the ({_COLOR}) ({_SHAPE}) on the (left|right|center)\.", c):
    return float(any(s == (m.group(1), m.group(2), m.group(3)) for s in f["shapes"]))
  if m := re.fullmatch(rf"The caption gives the ({_COLOR}) bar the value (\d+)\.", c):
    return float(any(b == (m.group(1), int(m.group(2))) for b in f["bars"]))
  if m := re.fullmatch(r"The caption mentions no shape other than: (.*)\.", c):
    allowed = {tuple(x.strip().split(" ", 1)) for x in m.group(1).split(",")}
    return float(all(s[:2] in allowed for s in f["shapes"]) and not f["unread"])
  if m := re.fullmatch(r"The caption mentions no bar other than: (.*)\.", c):
    allowed = {x.strip() for x in m.group(1).split(",")}
    return float(all(b[0] in allowed for b in f["bars"]) and not f["unread"])
  raise ValueError(f"scene_rubric_check: {criterion!r} is not a rubric of the built-in caption task")
