"""SFT data that teaches a small text model to be CapRL's answerer on the built-in caption task.

CapRL's answerer is a text LLM that reads a caption and answers a multiple-choice question about the image it
never saw. On the built-in caption task (`jaxrl.data.BuiltinCaptionTask`) such a model has to be trained first:
each record here is CapRL's answerer prompt (`CapRLConfig.template` with a caption, one of the scene's questions
and its options shuffled with the "cannot be answered" option added, as `caprl_reward` builds it) and, as the
assistant's reply, the words of the caption the question turns on, what the caption answers, then the letter an
exact reader of the caption gives (`scene_answerer`): ``" blue 1 B"``, ``" circle 0 A"``, ``" red square left C"``,
``" blue none C"``. What the caption states, not what the image shows, and "cannot be answered" where the caption
does not settle the question. The words before the letter are steps a 4-layer model from random init needs: asked
for the letter alone, or for the answer and the letter, it learnt to map an answer to its letter but not to find
the answer in the caption, and answered ``0`` to every count (docs/benchmarks.md); naming the asked-about word
first turns finding it into copying the token that follows its match in the caption. `caprl_reward` takes the
first option letter of the reply (an upper-case letter standing alone), so the words do not count.

The captions are the scenes' reference captions and the mistakes a sampled captioner makes: another colour,
kind or side; a few characters inserted, deleted or replaced; a caption cut short; another count; nothing.
Train and held-out records come from the caption task's own train and held-out scenes.
"""

from __future__ import annotations

import dataclasses
import re
import string
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from jaxrl import data as data_lib
from jaxrl.rewards._caprl import CAPTION_TEMPLATE, CapRLConfig, MCQuestion, _listing, parse_questions, shuffled_options
from jaxrl.rewards._caption_rules import asked_about, caption_answer, scene_answerer

__all__ = ["COMPACT_TEMPLATE", "CaptionAnswerTask", "answerer_words", "build_caption_answerer_tokenizer",
           "caption_answerer_records", "caption_answerer_tokenizer_dir", "perturb_caption"]

COMPACT_TEMPLATE = "Description:\n{caption}\n\nQuestion: {question}\nOptions:\n{options}\n\nAnswer:"
"""The tiny CapRL recipe's answerer prompt (configs/caprl_tiny.yaml, configs/sft_caprl_answerer_tiny.yaml):
`CAPTION_TEMPLATE`'s fields without its instructions."""

_WORDS = {"color": tuple(data_lib.COLORS), "shape": tuple(data_lib.SHAPES), "side": ("left", "right", "center")}
_NOISE = string.ascii_lowercase + " "


def answerer_words() -> list[str]:
  """The word-level vocabulary of the tiny answerer's tokenizer (`build_caption_answerer_tokenizer`): every word
  and number of CapRL's prompts on the caption task (both templates, the questions, options, the caption
  grammar, the option letters A-T, the chat roles), each with and without the space before it, and the printable
  characters, in a fixed order. A misspelt word of a sampled caption is not in it and reads as ``<|unk|>``."""
  texts = [CAPTION_TEMPLATE, COMPACT_TEMPLATE, CapRLConfig().unanswerable, "Cannot be answered. none user assistant",
           " ".join(data_lib.COLORS), " ".join(data_lib.SHAPES), "left right center shape shapes bar bars",
           "How many shapes are in the image? How many bars are in the chart? Which colour is the tallest bar?",
           "Is the on the left or on the right of the image? What is the value of the",
           " ".join(string.ascii_uppercase[:20]), " ".join(s + "s" for s in data_lib.SHAPES),
           " ".join(str(k) for k in range(21))]
  words = {w.strip() for t in texts for w in re.findall(data_lib.WORD_PIECES, t) if w.strip().isalnum()}
  pieces = sorted(words) + sorted(" " + w for w in words)
  return pieces + [c for c in data_lib.CHARACTERS if not c.isalnum()]


def build_caption_answerer_tokenizer(out_dir: str | Path):
  """Saves the tiny answerer's word-level chat tokenizer (`answerer_words`, the tiny tokenizer's special tokens
  and chat template) to `out_dir`; committed as ``jaxrl/assets/caption_answerer_tokenizer``. A word per token
  keeps CapRL's prompt at ~50 tokens (~170 characters): a 4-layer model from random init learns to answer from
  it; at one token per character it stayed near chance (docs/benchmarks.md)."""
  return data_lib.build_tiny_tokenizer(out_dir, words=answerer_words())


def caption_answerer_tokenizer_dir() -> Path:
  """Path of the committed tiny answerer tokenizer (`build_caption_answerer_tokenizer`)."""
  return Path(str(resources.files("jaxrl") / "assets" / "caption_answerer_tokenizer"))


def perturb_caption(caption: str, rng: np.random.Generator, *, p: float = 0.6) -> str:
  """`caption` with one of a sampled captioner's mistakes (module docstring), drawn from `rng` with
  probability `p`, else unchanged."""
  if rng.random() >= p:
    return caption
  u = 0.4 + 0.6 * rng.random()  # which mistake: the bands below, as drawn at p = 0.6
  if u < 0.6:  # another colour, kind or side
    words = [w for ws in _WORDS.values() for w in ws if re.search(rf"\b{w}\b", caption)]
    if words:
      old = words[rng.integers(len(words))]
      group = next(ws for ws in _WORDS.values() if old in ws)
      new = group[rng.integers(len(group))]
      return re.sub(rf"\b{old}\b", new, caption, count=1)
    return caption
  if u < 0.85:  # 1-3 characters inserted, deleted or replaced
    chars = list(caption)
    for _ in range(int(rng.integers(1, 4))):
      i, op = int(rng.integers(len(chars) + 1)), rng.integers(3)
      c = _NOISE[rng.integers(len(_NOISE))]
      if op == 0 or i == len(chars):
        chars.insert(i, c)
      elif op == 1:
        del chars[i]
      else:
        chars[i] = c
    return "".join(chars)
  if u < 0.95:  # cut short
    return caption[:int(rng.integers(len(caption)))]
  if u < 0.98:  # another count
    return re.sub(r"^\d+", str(int(rng.integers(4))), caption)
  return ""


def caption_answerer_records(captions: list[dict[str, Any]], n: int, *, seed: int,
                             config: CapRLConfig | None = None, perturb: float = 0.6) -> list[dict[str, Any]]:
  """``n`` chat records teaching CapRL's answerer prompt (module docstring), drawn from caption-task records
  `captions` (each with ``caption`` and ``questions``), deterministic in `seed`. Each record also carries the
  ``caption`` and ``question`` it asks about and ``letter``, the reply."""
  cfg = CapRLConfig() if config is None else config
  rng = np.random.default_rng(seed)
  unanswerable = cfg.unanswerable if cfg.add_unanswerable else None
  questions = [parse_questions(rec["questions"]) for rec in captions]  # once per scene, not per draw
  out = []
  for _ in range(n):
    i = rng.integers(len(captions))
    q: MCQuestion = questions[i][rng.integers(len(questions[i]))]
    caption = perturb_caption(captions[i]["caption"], rng, p=perturb)
    opts, _ = shuffled_options(q, seed=int(rng.integers(2**31)), round_=int(rng.integers(cfg.rounds)),
                               unanswerable=unanswerable)
    prompt = cfg.template.format(caption=caption, question=q.question, options=_listing(opts))
    letter = scene_answerer([{"role": "user", "content": prompt}])
    said = caption_answer(caption, q.question)
    reply = f" {asked_about(q.question)} {said if said is not None else 'none'} {letter}"
    out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
                "caption": caption, "question": q.question, "letter": letter})
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptionAnswerTask(data_lib.SceneTaskSection):
  """``data.caption_answer_task`` of ``jaxrl sft`` for a text model: CapRL answerer records
  (`caption_answerer_records`) over the built-in caption task's scenes, with the same scene knobs as the
  RL recipe's ``data.caption_task`` and the same answerer prompt as its ``reward.kwargs.config``."""

  _key: ClassVar[str] = "data.caption_answer_task"
  _task_key: ClassVar[str] = "data.caption_answer_task"
  n_train: int = 40000
  "Answerer records (prompt, reply) drawn from ``scenes`` train scenes."
  scenes: int = 2000
  "Distinct caption-task scenes per split to draw the records from."
  answerer: CapRLConfig = dataclasses.field(default_factory=CapRLConfig)
  "The answerer prompt as the RL recipe's ``reward.kwargs.config`` builds it (template, rounds, unanswerable)."
  perturb: float = 0.6
  "Share of captions given a sampled captioner's mistake (`perturb_caption`)."

  def __post_init__(self):
    super().__post_init__()
    if self.scenes < 1:
      raise ValueError(f"{self._key}.scenes must be >= 1, got {self.scenes!r}")
    if not 0 <= self.perturb <= 1:
      raise ValueError(f"{self._key}.perturb must be in [0, 1], got {self.perturb!r}")

  def records(self, split: Literal["train", "heldout"]) -> list[dict[str, Any]]:
    n_scenes = self.scenes if split == "train" else min(self.scenes, max(self.n_heldout, 1))
    captions = data_lib.generate_caption_task(n_scenes, seed=self.seed, split=split, config=self.task)
    n = self.n_train if split == "train" else self.n_heldout
    return caption_answerer_records(captions, n, seed=self.seed * 2 + (split == "heldout"), config=self.answerer,
                                    perturb=self.perturb)
