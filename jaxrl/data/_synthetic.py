"""Built-in synthetic task: multi-step integer arithmetic with a worked answer.

Each problem is an expression such as ``3+4*2=?`` and its answer shows the steps in precedence
order, ``4*2=8; 3+8=11. Answer: 11``. The easiest level (one-digit ``a+b``) is meant to be learnt
by a tiny model within minutes on a CPU; harder levels add terms, operators and digits. Problems
are split into train and held-out sets by a hash of the question text, so the two never share a
question whatever the seeds. A multi-turn variant continues a conversation with ``Then *3=?``
turns that act on the previous answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxrl import _extras

_OPS = ("+", "-", "*")
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
  """Difficulty knobs of the arithmetic task; :meth:`level` gives the presets."""

  min_terms: int = 2
  "Fewest operands in the first question."
  max_terms: int = 2
  "Most operands in the first question."
  max_value: int = 9
  "Operands are drawn uniformly from 0..max_value."
  ops: tuple[str, ...] = ("+",)
  "Operators to draw from, a subset of ``+``, ``-``, ``*``."
  num_turns: int = 1
  "Assistant turns per conversation; turns after the first apply one operator to the last answer."
  heldout_fraction: float = 0.1
  "Fraction of the question space reserved for the held-out split (by question hash)."

  def __post_init__(self):
    if self.min_terms < 2:
      raise ValueError(f"min_terms must be >= 2, got {self.min_terms!r}")
    if self.max_terms < self.min_terms:
      raise ValueError(f"max_terms must be >= min_terms={self.min_terms}, got {self.max_terms!r}")
    if self.max_value < 1:
      raise ValueError(f"max_value must be >= 1, got {self.max_value!r}")
    if not self.ops or any(op not in _OPS for op in self.ops):
      raise ValueError(f"ops must be a non-empty subset of {list(_OPS)}, got {self.ops!r}")
    if self.num_turns < 1:
      raise ValueError(f"num_turns must be >= 1, got {self.num_turns!r}")
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")

  @classmethod
  def level(cls, difficulty: int, **overrides) -> ArithmeticConfig:
    """Presets: 0 one-digit ``a+b``; 1 one-digit ``a op b``; 2 two or three one-digit terms;
    3 two or three terms up to 99; 4 three or four terms up to 99."""
    presets = {
        0: dict(min_terms=2, max_terms=2, max_value=9, ops=("+",)),
        1: dict(min_terms=2, max_terms=2, max_value=9, ops=_OPS),
        2: dict(min_terms=2, max_terms=3, max_value=9, ops=_OPS),
        3: dict(min_terms=2, max_terms=3, max_value=99, ops=_OPS),
        4: dict(min_terms=3, max_terms=4, max_value=99, ops=_OPS),
    }
    if difficulty not in presets:
      raise ValueError(f"difficulty must be one of {sorted(presets)}, got {difficulty!r}")
    return cls(**{**presets[difficulty], **overrides})


def solve(numbers: list[int], ops: list[str], *, slip: tuple[int, int] | None = None) -> tuple[list[str], int]:
  """Evaluates ``n0 op0 n1 op1 ...`` with ``*`` first, then ``+``/``-`` left to right.

  ``slip=(k, delta)`` makes step ``k``'s result off by ``delta`` and the later steps carry the wrong value on:
  a worked answer with one wrong step (the rejected answers of the preference pairs, ``jaxrl.pref``).

  Returns:
    The steps (``"4*2=8"``, ...) in the order they are done, and the value.
  """
  numbers, ops = list(numbers), list(ops)
  steps = []
  for level in (("*",), ("+", "-")):
    i = 0
    while i < len(ops):
      if ops[i] in level:
        a, b, op = numbers[i], numbers[i + 1], ops[i]
        value = a * b if op == "*" else a + b if op == "+" else a - b
        if slip is not None and len(steps) == slip[0]:
          value += slip[1]
        steps.append(f"{a}{op}{b}={value}")
        numbers[i:i + 2] = [value]
        del ops[i]
      else:
        i += 1
  return steps, numbers[0]


def _expression(numbers: list[int], ops: list[str]) -> str:
  return "".join(f"{n}{op}" for n, op in zip(numbers, ops)) + str(numbers[-1])


def _is_heldout(key: str, fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
  return h / 2.0**64 < fraction


def _sample_conversation(rng: np.random.Generator, cfg: ArithmeticConfig):
  n_terms = int(rng.integers(cfg.min_terms, cfg.max_terms + 1))
  numbers = [int(x) for x in rng.integers(0, cfg.max_value + 1, size=n_terms)]
  ops = [cfg.ops[int(i)] for i in rng.integers(0, len(cfg.ops), size=n_terms - 1)]
  steps, value = solve(numbers, ops)
  turns = [(f"{_expression(numbers, ops)}=?", f"{'; '.join(steps)}. Answer: {value}")]
  for _ in range(cfg.num_turns - 1):
    op = cfg.ops[int(rng.integers(0, len(cfg.ops)))]
    operand = int(rng.integers(0, cfg.max_value + 1))
    (step,), new = solve([value, operand], [op])
    turns.append((f"Then {op}{operand}=?", f"{step}. Answer: {new}"))
    value = new
  return turns, str(value)


def generate_arithmetic(
    n: int,
    *,
    seed: int,
    split: Literal["train", "heldout"] = "train",
    config: ArithmeticConfig | None = None,
    format: Literal["messages", "prompt_completion"] = "messages",  # noqa: A002
    unique: bool = False,
) -> list[dict[str, Any]]:
  """Draws ``n`` arithmetic records (deterministic in ``seed``) from one split.

  Args:
    n: number of records.
    seed: seed of the draw.
    split: ``train`` or ``heldout``; a question belongs to exactly one split, decided by a hash
      of all of its user turns and ``config.heldout_fraction``.
    config: difficulty (default :meth:`ArithmeticConfig.level` 0: one-digit ``a+b``).
    format: ``messages`` (``{"messages": [...], "answer"}``, several turns when
      ``config.num_turns > 1``) or ``prompt_completion`` (``{"prompt", "completion", "answer"}``,
      single turn only).
    unique: draw distinct questions (raises if the split has fewer than ``n``).

  Returns:
    A list of JSON-ready dicts; ``answer`` is the final answer as a string.
  """
  cfg = config or ArithmeticConfig.level(0)
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  if format not in ("messages", "prompt_completion"):
    raise ValueError(f"format must be 'messages' or 'prompt_completion', got {format!r}")
  if format == "prompt_completion" and cfg.num_turns != 1:
    raise ValueError(f"format='prompt_completion' needs num_turns=1, got {cfg.num_turns}")
  rng = np.random.default_rng([seed, 0 if split == "train" else 1])
  want_heldout = split == "heldout"
  records, seen = [], set()
  attempts, max_attempts = 0, 100 * n + 1000
  while len(records) < n:
    attempts += 1
    if attempts > max_attempts:
      raise ValueError(
          f"could only draw {len(records)} of {n} {'distinct ' if unique else ''}{split} questions "
          f"from {cfg}; lower n or raise the difficulty")
    turns, answer = _sample_conversation(rng, cfg)
    key = "\n".join(q for q, _ in turns)
    if _is_heldout(key, cfg.heldout_fraction) != want_heldout or (unique and key in seen):
      continue
    seen.add(key)
    if format == "prompt_completion":
      (question, completion), = turns
      records.append({"prompt": question, "completion": completion, "answer": answer})
    else:
      messages = []
      for question, completion in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": completion}]
      records.append({"messages": messages, "answer": answer})
  return records


def extract_answer(completion: str) -> str | None:
  """The integer after the last ``Answer:`` in ``completion`` (as a string), or None."""
  matches = _ANSWER_RE.findall(completion)
  return matches[-1] if matches else None


def exact_match(completion: str, answer: str | int) -> bool:
  """Whether the extracted answer of ``completion`` equals ``answer``."""
  got = extract_answer(completion)
  return got is not None and got == str(answer).strip()


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
  """Writes one JSON object per line (UTF-8) and returns the path."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  return path


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinTask:
  """Config section ``data.builtin`` of the SFT and RL trainers: the built-in arithmetic task.

  :meth:`records` draws a split: ``n_train`` train records (repeats allowed) or ``n_heldout``
  distinct held-out ones (never in the train split).
  """

  n_train: int = 4000
  "Records drawn from the train split."
  n_heldout: int = 64
  "Distinct held-out records (never in the train split)."
  difficulty: int = 2
  "ArithmeticConfig.level: 0 = one-digit a+b ... 4 = four terms up to 99."
  num_turns: int = 1
  "Assistant turns per conversation (ArithmeticConfig.num_turns)."
  seed: int = 0

  def __post_init__(self):
    if self.n_train < 1:
      raise ValueError(f"data.builtin.n_train must be >= 1, got {self.n_train!r}")
    if self.n_heldout < 0:
      raise ValueError(f"data.builtin.n_heldout must be >= 0, got {self.n_heldout!r}")
    if self.difficulty not in range(5):
      raise ValueError(f"data.builtin.difficulty must be in 0..4, got {self.difficulty!r}")
    if self.num_turns < 1:
      raise ValueError(f"data.builtin.num_turns must be >= 1, got {self.num_turns!r}")

  @property
  def task(self) -> ArithmeticConfig:
    return ArithmeticConfig.level(self.difficulty, num_turns=self.num_turns)

  def records(self, split: Literal["train", "heldout"]) -> list[dict[str, Any]]:
    if split == "train":
      return generate_arithmetic(self.n_train, seed=self.seed, split="train", config=self.task)
    if not self.n_heldout:
      return []
    return generate_arithmetic(self.n_heldout, seed=self.seed, split="heldout", config=self.task, unique=True)


def write_arithmetic_splits(
    out_dir: str | Path,
    *,
    n_train: int,
    n_heldout: int,
    seed: int = 0,
    config: ArithmeticConfig | None = None,
    format: Literal["messages", "prompt_completion"] = "messages",  # noqa: A002
) -> dict[str, Path]:
  """Writes ``train.jsonl`` and ``heldout.jsonl`` (distinct held-out questions) under ``out_dir``."""
  out_dir = Path(out_dir)
  train = generate_arithmetic(n_train, seed=seed, split="train", config=config, format=format)
  heldout = generate_arithmetic(
      n_heldout, seed=seed, split="heldout", config=config, format=format, unique=True)
  return {"train": write_jsonl(train, out_dir / "train.jsonl"),
          "heldout": write_jsonl(heldout, out_dir / "heldout.jsonl")}


def reasoning_gym_records(name: str, n: int, *, seed: int) -> list[dict[str, Any]]:
  """Prompt/answer records from a ``reasoning-gym`` task (optional dependency, not installed).

  Raises:
    ImportError: when ``reasoning_gym`` is not installed.
  """
  try:
    reasoning_gym = _extras.require("reasoning_gym")
  except ImportError as e:
    raise ImportError(
        "reasoning_gym_records needs the optional package 'reasoning-gym' "
        "(pip install reasoning-gym); the built-in task is generate_arithmetic") from e
  data = reasoning_gym.create_dataset(name, size=n, seed=seed)
  return [{"prompt": str(entry["question"]), "answer": str(entry["answer"])} for entry in data]
