"""Worked chains, Coconut's stage-k examples and their column-aligned rows.

A *chain* is a question, its reasoning steps and the answer (the built-in arithmetic task's
``4*2=8; 3+8=11. Answer: 11`` has the steps ``4*2=8`` and ``3+8=11``; any JSONL with a ``steps`` list
works too). Stage ``k`` of the curriculum (Hao et al. 2024, Coconut, §3 "Training Procedure")
replaces the first ``k`` steps by ``k·c`` continuous thoughts (all steps, ``s·c`` thoughts, when the
chain has ``s < k`` steps), wrapped in ``<bot>``/``<eot>`` (not counted in ``c``)::

    [question (chat prompt)] <bot> [θ × min(k, s)·c] <eot> [steps k.. ; "Answer: v" <eos>]

The loss is on the language tokens after ``<eot>`` only (never on the question, the markers or the
thoughts).

Two row layouts feed the latent forward:

* *Column-aligned* (:class:`Layout`, :func:`make_rows`), one example per row: the prompt is
  left-padded so that the last thought slot of every row sits at the same column ``P + N - 1`` (``P``
  the prefix width, ``N`` the most thoughts of any row) and ``<eot>`` at column ``P + N``;
  :func:`jaxrl.latent.latent_hidden` runs each pass as a contiguous chunk of every row.
* *Packed* (:class:`PackedLayout`, :func:`pack_rows`), several examples per row, each its own
  segment (ids ``1, 2, ...``; positions restart), exactly like SFT packing. Each row also carries the
  columns every pass of :func:`jaxrl.latent.packed_latent_hidden` gathers: pass 0 the prompts (up to
  ``<bot>``), thought pass ``m`` one thought per example (right-aligned, so every example's last
  thought is in the final pass), the final pass the last thoughts and the suffixes. The pass widths
  are static budgets of the layout, and the packer fills a row only while every budget holds, so one
  program serves every batch.
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
    ``thought_mask`` (bool, continuous-thought columns), ``eot_mask``/``eot_label`` (float32: the
    ``<eot>`` head's decision columns, ``<bot>`` and every thought of latent examples, and its label,
    1 on the last of them, whose next input is ``<eot>``).
  """
  b, t = len(examples), layout.length
  p_end = layout.prefix + layout.thoughts  # column of the suffix's first token
  out = {"tokens": np.full((b, t), tokens.pad, np.int32), "positions": np.zeros((b, t), np.int32),
         "segment_ids": np.zeros((b, t), np.int32), "targets": np.full((b, t), tokens.pad, np.int32),
         "loss_mask": np.zeros((b, t), np.float32), "thought_mask": np.zeros((b, t), bool),
         "eot_mask": np.zeros((b, t), np.float32), "eot_label": np.zeros((b, t), np.float32)}
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
    _set_eot(out, r, e, p_end)
  return out


def _latent_count(e: StageExample) -> int:
  return e.n_thoughts if e.kind == "latent" else 0


def _head(e: StageExample, tokens: LatentTokens) -> np.ndarray:
  """The example's tokens before the suffix: prompt, then its slots (``<pause>`` or placeholder ids)."""
  slot = tokens.pause if e.kind == "pause" else tokens.pad
  return np.concatenate([e.prompt, np.full(e.n_thoughts if e.kind != "none" else 0, slot, np.int32)])


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Static budgets of packed rows for the ``N + 1``-pass forward.

  A row is ``length = first + (thoughts - 1)·examples + last`` columns (no thought passes when
  ``thoughts <= 1``). Pass 0 gathers ``first`` columns (each example's prompt up to ``<bot>``, with
  its ``<pause>`` slots), each of the ``thoughts - 1`` thought passes one column per example slot,
  the final pass ``last`` columns (each example's last thought and suffix). With ``thoughts == 0``
  the row is one plain packed pass.
  """

  first: int
  examples: int
  thoughts: int
  last: int

  @property
  def length(self) -> int:
    return self.first + max(self.thoughts - 1, 0) * self.examples + self.last

  def needs(self, e: StageExample) -> tuple[int, int]:
    """``(pass-0 columns, final-pass columns)`` of one example."""
    n, total = _latent_count(e), len(e.prompt) + (e.n_thoughts if e.kind != "none" else 0) + len(e.suffix)
    if self.thoughts == 0:
      return 0, total
    pre = len(e.prompt) + (e.n_thoughts if e.kind == "pause" else 0)
    return pre, total - pre - max(n - 1, 0)

  @classmethod
  def fit(cls, examples: Iterable[StageExample], length: int) -> PackedLayout:
    """Budgets for rows of about ``length`` columns, split in proportion to the examples' needs.

    ``examples`` (the example slots per row) is the mean number of examples that fill ``length``
    when there are thought passes (each slot costs a column in each), else the most that fit; the
    rest of the row is split between pass 0 and the final pass as the examples' prompt and suffix
    tokens are.

    Raises:
      ValueError: when ``length`` cannot hold the longest example.
    """
    examples = list(examples)
    if not examples:
      raise ValueError("PackedLayout.fit needs at least one example")
    n = max(_latent_count(e) for e in examples)
    probe = cls(first=0, examples=1, thoughts=n, last=0)
    pre, post = np.asarray([probe.needs(e) for e in examples]).T
    mid = max(n - 1, 0)
    if mid:  # each example slot costs a column in every thought pass: size them for the mean example
      e_slots = max(1, int(length // (pre.mean() + mid + post.mean())))
    else:  # no thought passes: slots are free, allow as many of the shortest examples as fit
      e_slots = max(1, int(length // (pre + post).min()))
    rest = length - mid * e_slots
    first = int(round(rest * pre.sum() / (pre.sum() + post.sum())))
    layout = cls(first=first, examples=e_slots, thoughts=n, last=rest - first)
    if layout.first < pre.max() or layout.last < post.max():
      raise ValueError(f"pack_length={length} cannot hold the longest example (needs pass-0 {int(pre.max())} and "
                       f"final-pass {int(post.max())} columns, got {layout}); raise pack_length")
    return layout


def pack_rows(examples: Sequence[StageExample], layout: PackedLayout, tokens: LatentTokens, *,
              num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
  """Packs ``examples`` in order (next fit) into rows of ``layout``.

  Args:
    examples: stage examples; packing stops at the first one that fits no remaining row.
    layout: the static budgets.
    tokens: ids from :func:`latent_tokens`.
    num_rows: rows to fill (default: as many as the examples need).

  Returns:
    ``(rows, used)``: ``used`` examples were packed. ``rows`` holds ``[B, T]`` ``tokens``,
    ``positions``, ``segment_ids`` (example ``i`` of a row has id ``i + 1``; 0 is padding),
    ``targets``, ``loss_mask``, ``thought_mask``, ``eot_mask``/``eot_label`` (:func:`eot_labels`), and
    the pass columns: ``first_idx [B, first]``, ``mid_idx [B, (N-1)·E]`` (pass-major), ``last_idx
    [B, last]`` (natural columns, -1 for unused slots), ``bot_slot [B, E]`` (the pass-0 slot of each
    example's last prompt column), ``last_thought_slot [B, E]`` (the final-pass slot of its last
    thought, -1 without thoughts), ``order [B, T]`` (the processed slot of every natural column; a
    permutation of ``[0, T)``).
  """
  rows: list[list[StageExample]] = [[]]
  used = {"pre": 0, "post": 0}
  for e in examples:
    pre, post = layout.needs(e)
    if _latent_count(e) > layout.thoughts:
      raise ValueError(f"example with {e.n_thoughts} thoughts does not fit {layout}")
    if pre > layout.first or post > layout.last:
      raise ValueError(f"example (prompt {len(e.prompt)}, suffix {len(e.suffix)}) does not fit {layout}")
    row = rows[-1]
    if len(row) == layout.examples or used["pre"] + pre > layout.first or used["post"] + post > layout.last:
      if num_rows is not None and len(rows) == num_rows:
        break
      rows.append(row := [])
      used = {"pre": 0, "post": 0}
    row.append(e)
    used["pre"] += pre
    used["post"] += post
  n_used = sum(len(r) for r in rows)
  if num_rows is not None:
    rows += [[] for _ in range(num_rows - len(rows))]
  return _packed_arrays(rows, layout, tokens), n_used


def _packed_arrays(rows: Sequence[Sequence[StageExample]], layout: PackedLayout,
                   tokens: LatentTokens) -> dict[str, np.ndarray]:
  b, t, n, e_slots = len(rows), layout.length, layout.thoughts, layout.examples
  mid_w = max(n - 1, 0) * e_slots
  full = lambda shape, v, dt: np.full(shape, v, dt)
  out = {"tokens": full((b, t), tokens.pad, np.int32), "positions": full((b, t), 0, np.int32),
         "segment_ids": full((b, t), 0, np.int32), "targets": full((b, t), tokens.pad, np.int32),
         "loss_mask": full((b, t), 0, np.float32), "thought_mask": full((b, t), False, bool),
         "eot_mask": full((b, t), 0, np.float32), "eot_label": full((b, t), 0, np.float32),
         "first_idx": full((b, layout.first), -1, np.int32), "mid_idx": full((b, mid_w), -1, np.int32),
         "last_idx": full((b, layout.last), -1, np.int32), "bot_slot": full((b, e_slots), 0, np.int32),
         "last_thought_slot": full((b, e_slots), -1, np.int32), "order": full((b, t), -1, np.int32)}
  first0, last0 = layout.first, layout.first + mid_w  # processed offsets of the thought and final passes
  for r, examples in enumerate(rows):
    col = c0 = c_last = 0
    for slot, e in enumerate(examples):
      head = _head(e, tokens)
      seq = np.concatenate([head, e.suffix])
      start, end = col, col + len(seq)
      out["tokens"][r, start:end] = seq
      out["positions"][r, start:end] = np.arange(len(seq))
      out["segment_ids"][r, start:end] = slot + 1
      out["targets"][r, start:end - 1] = seq[1:]
      s0 = start + len(head)  # the suffix's first column
      out["loss_mask"][r, s0 - 1:s0 - 1 + len(e.suffix)] = e.suffix_loss
      k = _latent_count(e)
      th0 = s0 - k  # first thought column
      out["thought_mask"][r, th0:s0] = True
      _set_eot(out, r, e, s0)
      if n == 0:  # one plain pass: every column is "final"
        cols_first, cols_last = np.arange(0), np.arange(start, end)
      else:
        cols_first, cols_last = np.arange(start, th0), np.arange(s0 - 1 if k else s0, end)
        for j in range(k - 1):  # thought j in thought pass (N - k) + j, right-aligned
          m = n - k + j
          out["mid_idx"][r, m * e_slots + slot] = th0 + j
          out["order"][r, th0 + j] = first0 + m * e_slots + slot
        out["bot_slot"][r, slot] = c0 + len(cols_first) - 1
        if k:
          out["last_thought_slot"][r, slot] = c_last
      out["first_idx"][r, c0:c0 + len(cols_first)] = cols_first
      out["order"][r, cols_first] = np.arange(c0, c0 + len(cols_first))
      out["last_idx"][r, c_last:c_last + len(cols_last)] = cols_last
      out["order"][r, cols_last] = last0 + np.arange(c_last, c_last + len(cols_last))
      c0, c_last, col = c0 + len(cols_first), c_last + len(cols_last), end
    # Padding columns take the unused processed slots, so ``order`` is a permutation.
    free = np.setdiff1d(np.arange(t), out["order"][r][out["order"][r] >= 0])
    out["order"][r, out["order"][r] < 0] = free
  return out


def _set_eot(out: dict[str, np.ndarray], r: int, e: StageExample, s0: int) -> None:
  """Decision columns of the ``<eot>`` head for one example whose suffix starts at column ``s0``."""
  if e.kind != "latent" or len(e.suffix) == 0:
    return
  k = e.n_thoughts
  out["eot_mask"][r, s0 - 1 - k:s0] = 1.0  # <bot> and every thought
  out["eot_label"][r, s0 - 1] = 1.0  # the last of them: the next input is <eot>


def padding_fraction(rows: Mapping[str, np.ndarray]) -> float:
  """Share of the row columns that hold no example token (``segment_ids == 0``)."""
  seg = np.asarray(rows["segment_ids"])
  return float(1.0 - (seg != 0).sum() / max(seg.size, 1))
