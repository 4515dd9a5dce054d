"""Worked chains, Coconut's stage-k examples and their column-aligned rows.

A *chain* is a question, its reasoning steps and the answer (the built-in arithmetic task's
``4*2=8; 3+8=11. Answer: 11`` has the steps ``4*2=8`` and ``3+8=11``; any JSONL with a ``steps`` list
works too). Stage ``k`` of the curriculum (Hao et al. 2024, Coconut, §3 "Training Procedure")
replaces the first ``k`` steps by ``k·c`` continuous thoughts (all steps, ``s·c`` thoughts, when the
chain has ``s < k`` steps), wrapped in ``<bot>``/``<eot>`` (not counted in ``c``)::

    [question (chat prompt)] <bot> [θ × min(k, s)·c] <eot> [steps k.. ; "Answer: v" <eos>]

The loss is on the language tokens after ``<eot>`` only (never on the question, the markers or the
thoughts).

Rows are *column-aligned*, one example per row: the prompt is left-padded so that the last thought
slot of every row sits at the same column ``P + N - 1`` (``P`` the prefix width, ``N`` the most
thoughts of any row) and ``<eot>`` at column ``P + N``. The latent forward
(:func:`jaxrl.latent.latent_hidden`) then runs pass 0 over columns ``[0, P)``, one column per pass
for the next ``N - 1`` thoughts and a last pass over ``[P + N - 1, T)``, each pass a contiguous chunk
of every row through the model's KV cache. Packing several examples into a row would put their
thoughts at different columns, so every pass would need per-row gathers of data-dependent width
(a recompile per batch) or one extra full pass; rows are therefore unpacked, and the padding this
costs is reported by the trainer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxrl import data as data_lib

BOT, EOT, PAUSE = "<bot>", "<eot>", "<pause>"
"""Special tokens added to the tokenizer: begin/end of latent thought, and the pause token."""

ThoughtKind = Literal["latent", "pause", "none"]
"""What fills the thought slots: continuous thoughts, ``<pause>`` tokens, or nothing (0 slots)."""


@dataclasses.dataclass(frozen=True)
class Chain:
  """One worked problem: question, reasoning steps (in order) and the final answer."""

  question: str
  steps: tuple[str, ...]
  answer: str


def chain_from_record(record: Mapping[str, Any], *, where: str = "record") -> Chain:
  """A :class:`Chain` from ``{"question" | "prompt": str, "steps": [str, ...], "answer": str | int}``.

  Raises:
    ValueError: naming ``where`` and the bad key.
  """
  if not isinstance(record, Mapping):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  question = record.get("question", record.get("prompt"))
  if not isinstance(question, str) or not question:
    raise ValueError(f"{where}: needs a non-empty string 'question' (or 'prompt'); keys {sorted(record)}")
  steps = record.get("steps")
  if not isinstance(steps, (list, tuple)) or not all(isinstance(s, str) and s for s in steps):
    raise ValueError(f"{where}: 'steps' must be a list of non-empty strings, got {steps!r}")
  answer = record.get("answer")
  if not isinstance(answer, (str, int)) or isinstance(answer, bool) or str(answer) == "":
    raise ValueError(f"{where}: 'answer' must be a non-empty string or an integer, got {answer!r}")
  return Chain(question=question, steps=tuple(steps), answer=str(answer))


def read_chains(path: str | Path) -> list[Chain]:
  """Chains from a JSONL file of ``question``/``steps``/``answer`` records (errors name file:line)."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"data file {path} not found")
  chains = []
  with path.open(encoding="utf-8") as f:
    for i, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
      chains.append(chain_from_record(record, where=f"{path}:{i}"))
  if not chains:
    raise ValueError(f"{path}: no records")
  return chains


def arithmetic_chains(n: int, *, seed: int, split: Literal["train", "heldout"] = "train",
                      difficulty: int = 2, unique: bool = False) -> list[Chain]:
  """Chains of the built-in arithmetic task: ``6+5+2=?`` → steps ``6+5=11``, ``11+2=13``, answer 13."""
  records = data_lib.generate_arithmetic(n, seed=seed, split=split, config=data_lib.ArithmeticConfig.level(difficulty),
                                         format="prompt_completion", unique=unique)
  chains = []
  for r in records:
    work = r["completion"][:r["completion"].rfind(". Answer:")]
    chains.append(Chain(question=r["prompt"], steps=tuple(work.split("; ")), answer=r["answer"]))
  return chains


def completion_text(steps: Sequence[str], answer: str) -> str:
  """``"s1; s2. Answer: v"`` (the built-in task's format), or ``"Answer: v"`` with no steps left."""
  return (f"{'; '.join(steps)}. " if steps else "") + f"Answer: {answer}"


@dataclasses.dataclass(frozen=True)
class LatentTokens:
  """Token ids the latent code path needs."""

  bot: int
  eot: int
  pause: int
  eos: int
  pad: int


def latent_tokens(tokenizer, vocab_size: int) -> LatentTokens:
  """Adds ``<bot>``, ``<eot>``, ``<pause>`` to ``tokenizer`` (in place, once) and returns the ids.

  The new ids must fit the model's embedding (``vocab_size`` rows): Hugging Face checkpoints and the
  tiny preset keep spare rows past the tokenizer's last id, which serve as these tokens' embeddings.

  Raises:
    ValueError: when the tokenizer, with the three tokens, exceeds ``vocab_size``.
  """
  tokenizer.add_tokens([BOT, EOT, PAUSE], special_tokens=True)
  bot, eot, pause = tokenizer.convert_tokens_to_ids([BOT, EOT, PAUSE])
  if max(bot, eot, pause) >= vocab_size:
    raise ValueError(f"latent tokens {BOT}/{EOT}/{PAUSE} got ids {bot}/{eot}/{pause}, beyond the model's "
                     f"vocab_size={vocab_size}; use a model with spare embedding rows")
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  return LatentTokens(bot=bot, eot=eot, pause=pause, eos=tokenizer.eos_token_id, pad=pad)


@dataclasses.dataclass(frozen=True)
class StageExample:
  """One example at one stage: ``prompt ++ [slot] * n_thoughts ++ suffix``."""

  prompt: np.ndarray  # [p] int32: chat prompt of the question, then <bot> (with markers)
  n_thoughts: int  # thought slots (continuous thoughts or <pause> tokens)
  kind: ThoughtKind
  suffix: np.ndarray  # [r] int32: <eot> (with markers), remaining steps, answer, end of turn
  suffix_loss: np.ndarray  # [r] bool: trained tokens of the suffix (not <eot>)
  answer: str


def prompt_ids(tokenizer, question: str, tokens: LatentTokens, *, markers: bool, kind: ThoughtKind,
               n_thoughts: int) -> tuple[np.ndarray, int]:
  """The decode-time prompt (chat prompt, ``<bot>``) and the number of thought slots after it."""
  ids = list(data_lib.encode_prompt(tokenizer, {"prompt": question}))
  if markers:
    ids.append(tokens.bot)
  return np.asarray(ids, np.int32), (0 if kind == "none" else n_thoughts)


def stage_example(chain: Chain, stage: int, *, c: int, tokenizer, tokens: LatentTokens, markers: bool = True,
                  kind: ThoughtKind = "latent", pad_thoughts: bool = False) -> StageExample:
  """Stage ``stage`` of ``chain``: the first ``min(stage, s)`` steps become ``min(stage, s)·c`` slots.

  Args:
    chain: the worked problem (``s = len(chain.steps)``).
    stage: curriculum stage ``k >= 0`` (0 = the full language chain).
    c: continuous thoughts per replaced step.
    tokenizer: the chat tokenizer (with :func:`latent_tokens` added).
    tokens: ids from :func:`latent_tokens`.
    markers: wrap the thoughts in ``<bot>``/``<eot>`` (Coconut and its ablations; not CoT/no-CoT).
    kind: ``latent`` continuous thoughts, ``pause`` tokens (pause as thought), ``none`` (w/o thought).
    pad_thoughts: use ``stage·c`` slots even when the chain has fewer steps (so a fixed count at
      decoding matches training); the spec's default is ``min(stage, s)·c``.
  """
  if stage < 0 or c < 0:
    raise ValueError(f"stage and c must be >= 0, got stage={stage}, c={c}")
  dropped = min(stage, len(chain.steps))
  n = (stage if pad_thoughts else dropped) * c
  prompt, n = prompt_ids(tokenizer, chain.question, tokens, markers=markers, kind=kind, n_thoughts=n)
  text = completion_text(chain.steps[dropped:], chain.answer) + tokenizer.eos_token
  body = tokenizer(text, add_special_tokens=False)["input_ids"]
  head = [tokens.eot] if markers else []
  suffix = np.asarray(head + list(body), np.int32)
  suffix_loss = np.asarray([False] * len(head) + [True] * len(body))
  return StageExample(prompt=prompt, n_thoughts=n, kind=kind, suffix=suffix, suffix_loss=suffix_loss,
                      answer=chain.answer)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static column layout of a batch: prefix width ``P``, thought columns ``N``, suffix width ``R``."""

  prefix: int
  thoughts: int
  suffix: int

  @property
  def length(self) -> int:
    return self.prefix + self.thoughts + self.suffix

  @classmethod
  def fit(cls, examples: Iterable[StageExample]) -> Layout:
    """The smallest layout holding every example (``N`` counts only continuous-thought slots)."""
    examples = list(examples)
    latent = [e.n_thoughts for e in examples if e.kind == "latent"]
    n = max(latent, default=0)
    # Pause slots are ordinary tokens: they live in the prefix, right after <bot>.
    prefix = max(len(e.prompt) + (e.n_thoughts if e.kind == "pause" else 0) for e in examples)
    return cls(prefix=prefix, thoughts=n, suffix=max(len(e.suffix) for e in examples))


def make_rows(examples: Sequence[StageExample], layout: Layout, tokens: LatentTokens) -> dict[str, np.ndarray]:
  """Column-aligned ``[B, T]`` rows (see the module docstring).

  Returns:
    ``tokens``, ``positions``, ``segment_ids`` (1 on the example, 0 on padding), ``targets``
    (next token), ``loss_mask`` (float32, 1 where the target is a trained suffix token),
    ``thought_mask`` (bool, continuous-thought columns).
  """
  b, t = len(examples), layout.length
  p_end = layout.prefix + layout.thoughts  # column of the suffix's first token
  out = {"tokens": np.full((b, t), tokens.pad, np.int32), "positions": np.zeros((b, t), np.int32),
         "segment_ids": np.zeros((b, t), np.int32), "targets": np.full((b, t), tokens.pad, np.int32),
         "loss_mask": np.zeros((b, t), np.float32), "thought_mask": np.zeros((b, t), bool)}
  for r, e in enumerate(examples):
    n_latent = e.n_thoughts if e.kind == "latent" else 0
    slots = [tokens.pause] * e.n_thoughts if e.kind == "pause" else [tokens.pad] * n_latent
    head = np.concatenate([e.prompt, np.asarray(slots, np.int32)])
    if n_latent > layout.thoughts or len(head) > p_end or len(e.suffix) > layout.suffix:
      raise ValueError(f"example (prompt {len(e.prompt)}, thoughts {e.n_thoughts}, suffix {len(e.suffix)}) "
                       f"does not fit {layout}")
    start = p_end - len(head)
    seq = np.concatenate([head, e.suffix])
    end = start + len(seq)
    out["tokens"][r, start:end] = seq
    out["positions"][r, start:end] = np.arange(len(seq))
    out["segment_ids"][r, start:end] = 1
    out["targets"][r, start:end - 1] = seq[1:]
    out["loss_mask"][r, p_end - 1:p_end - 1 + len(e.suffix)] = e.suffix_loss
    out["thought_mask"][r, p_end - n_latent:p_end] = True
  return out
