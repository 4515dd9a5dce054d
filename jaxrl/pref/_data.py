"""Preference pairs: JSONL records or the built-in arithmetic pairs, tokenised and packed into rows.

A pair ``{"prompt", "chosen", "rejected"}`` becomes two sequences through the chat template: the prompt
(a string, one user turn, or a list of chat messages) followed by the chosen (resp. rejected) answer (a
string, one assistant turn, or a list of messages). The answer's tokens are the scored ones.

A batch packs the ``2P`` sequences of its ``P`` pairs into ``[rows, seq_len]`` arrays (any sequence may share
a row with any other; ``segment_ids`` keep them apart, ``positions`` restart at 0) and tags every token with
its sequence: ``seq_ids`` is ``2i + 1`` on pair ``i``'s chosen sequence and ``2i + 2`` on its rejected one (0 on
padding). Sequence log-probs are sums over the tokens of one ``seq_ids`` value, so they do not depend on
which row a sequence landed in. With micro-batches every micro-batch is packed on its own (its pairs in its
rows, ids local to it), so the step can split rows and pairs alike.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl import data as data_lib

PAIR_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "seq_ids")
"""The ``[rows, seq_len]`` arrays of a packed preference batch (``loss_mask`` float32, the rest int32)."""


@dataclasses.dataclass(frozen=True)
class Pair:
  """One tokenised pair: the chosen and rejected sequences (``tokens``, ``loss_mask`` [L] each) and the
  record's optional ``margin`` (the Bradley–Terry margin ``m``; 0 when absent). A KTO unit
  (:func:`read_kto_units`) is a pair too: ``chosen`` the labelled completion, ``rejected`` its KL sequence,
  ``desirable`` the label."""

  chosen: dict[str, np.ndarray]
  rejected: dict[str, np.ndarray]
  where: str
  margin: float = 0.0
  desirable: bool = True


def _messages(value: Any, role: str, field: str) -> list[dict[str, Any]]:
  if isinstance(value, str):
    return [{"role": role, "content": value}]
  if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in value):
    return [{"role": m["role"], "content": m["content"]} for m in value]
  raise data_lib.DataError(f"'{field}' must be a string or a non-empty list of {{role, content}} messages, "
                           f"got {type(value).__name__}", reason="wrong type")


def pair_messages(record: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """``(chosen conversation, rejected conversation)`` of a ``{"prompt", "chosen", "rejected"}`` record; the
  answers' assistant turns are trained, the prompt's are not.

  Raises:
    DataError: naming the missing or malformed field.
  """
  if not isinstance(record, dict):
    raise data_lib.DataError(f"record must be a JSON object, got {type(record).__name__}", reason="not a JSON object")
  missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
  if missing:
    raise data_lib.DataError(f"missing field(s) {missing}; a pair needs 'prompt', 'chosen' and 'rejected'",
                             reason="missing field")
  return (answer_messages(record["prompt"], record["chosen"], field="chosen"),
          answer_messages(record["prompt"], record["rejected"], field="rejected"))


def answer_messages(prompt: Any, answer: Any, *, field: str = "completion") -> list[dict[str, Any]]:
  """The conversation of ``prompt`` (a string: one user turn; or chat messages, not trained) followed by
  ``answer`` (a string: one assistant turn; or messages, the assistant's trained); ``field`` names the answer
  in errors.

  Raises:
    DataError: naming the malformed field.
  """
  conversation = [dict(m, train=False) for m in _messages(prompt, "user", "prompt")]
  answer = _messages(answer, "assistant", field)
  if not any(m["role"] == "assistant" for m in answer):
    raise data_lib.DataError(f"'{field}' has no assistant message", reason="no assistant turn")
  return conversation + answer


def encode_pair(tokenizer, record: Any, where: str) -> Pair:
  """Tokenises a pair record (:func:`pair_messages`) with the tokenizer's chat template."""
  try:
    chosen, rejected = (data_lib.encode_chat(tokenizer, m) for m in pair_messages(record))
  except data_lib.DataError as e:
    raise data_lib.DataError(f"{where}: {e}", reason=e.reason) from None
  margin = record.get("margin", 0.0)
  if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin):
    raise data_lib.DataError(f"{where}: 'margin' must be a finite number, got {margin!r}", reason="wrong type")
  keep = ("tokens", "loss_mask")
  return Pair({k: chosen[k] for k in keep}, {k: rejected[k] for k in keep}, where, float(margin))


def read_pairs(paths: tuple[str, ...], tokenizer) -> list[Pair]:
  """Every pair of the JSONL ``paths``, in file order.

  Raises:
    DataError: ``file:line: reason`` for the first line that is not a valid pair.
  """
  return [encode_pair(tokenizer, record, where) for record, where in _jsonl_records(paths)]


def _jsonl_records(paths: tuple[str, ...]):
  """``(record, "file:line")`` for every non-blank line of the JSONL ``paths``, in file order.

  Raises:
    DataError: ``file:line: malformed JSON (...)``.
  """
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        where = f"{path}:{n}"
        try:
          yield json.loads(line), where
        except json.JSONDecodeError as e:
          raise data_lib.DataError(f"{where}: malformed JSON ({e.msg})", reason="malformed JSON") from None


KTO_KEYS = ("prompt", "completion", "label")
"""The fields of a KTO record (a labelled single)."""


def read_kto_units(paths: tuple[str, ...], tokenizer) -> list[Pair]:
  """KTO's labelled singles ``{"prompt", "completion", "label": true/false}`` of the JSONL ``paths`` as units:
  :class:`Pair` ``(chosen = prompt + completion, rejected = the KL sequence, desirable = label)``. The KL
  sequence of record ``j`` is its prompt with the completion of record ``j - 1`` (file order, cyclic): the
  mismatched pairs from which KTO estimates ``KL(π || π_ref)`` (TRL's ``_get_kl_dataset`` rotates the
  completions by one inside each batch instead; both pair a prompt with another example's completion).

  Raises:
    DataError: ``file:line: reason`` for the first line that is not a valid single; fewer than 2 records.
  """
  records, wheres = [], []
  for record, where in _jsonl_records(paths):
    _check_single(record, where)
    records.append(record)
    wheres.append(where)
  if len(records) == 1:
    raise data_lib.DataError(f"{wheres[0]}: KTO needs at least 2 records (the KL estimate pairs a prompt with "
                             "another record's completion)", reason="no data")
  units = []
  for j, (record, where) in enumerate(zip(records, wheres)):
    other = records[j - 1]["completion"]
    try:
      seq, kl = (data_lib.encode_chat(tokenizer, answer_messages(record["prompt"], c))
                 for c in (record["completion"], other))
    except data_lib.DataError as e:
      raise data_lib.DataError(f"{where}: {e}", reason=e.reason) from None
    keep = ("tokens", "loss_mask")
    units.append(Pair({k: seq[k] for k in keep}, {k: kl[k] for k in keep}, where, desirable=record["label"]))
  return units


def _check_single(record: Any, where: str) -> None:
  """A KTO record has ``prompt``, ``completion`` and a boolean ``label``; else a ``DataError`` naming ``where``."""
  if not isinstance(record, dict):
    raise data_lib.DataError(f"{where}: record must be a JSON object, got {type(record).__name__}",
                             reason="not a JSON object")
  missing = [k for k in KTO_KEYS if k not in record]
  if missing:
    raise data_lib.DataError(f"{where}: missing field(s) {missing}; a KTO record needs 'prompt', 'completion' and "
                             "'label'", reason="missing field")
  if not isinstance(record["label"], bool):
    raise data_lib.DataError(f"{where}: 'label' must be true or false, got {record['label']!r}", reason="wrong type")


def _wrong_answer(rng: np.random.Generator, numbers: list[int], ops: list[str], value: int) -> str:
  """A worked answer to a perturbed problem (one operand moved by 1 or 2) with a different final value; when
  no such move changes the value (``0*0``), the correct steps with the last result and the answer off by one."""
  for _ in range(32):
    wrong = list(numbers)
    i = int(rng.integers(len(wrong)))
    wrong[i] = max(0, wrong[i] + int(rng.choice([-2, -1, 1, 2])))
    steps, got = data_lib.solve(wrong, ops)
    if got != value:
      return f"{'; '.join(steps)}. Answer: {got}"
  steps, _ = data_lib.solve(numbers, ops)
  steps[-1] = f"{steps[-1].rsplit('=', 1)[0]}={value + 1}"
  return f"{'; '.join(steps)}. Answer: {value + 1}"


def _slipped_answer(rng: np.random.Generator, numbers: list[int], ops: list[str], value: int) -> str | None:
  """A worked answer to the right question with one step's arithmetic wrong (off by 1 to 3) and the error
  carried to a wrong final answer; ``None`` when 32 draws all cancel out (a later ``*0``)."""
  for _ in range(32):
    slip = int(rng.integers(len(ops)))
    delta = int(rng.choice([-3, -2, -1, 1, 2, 3]))
    steps, got = data_lib.solve(numbers, ops, slip=(slip, delta))
    if got != value:
      return f"{'; '.join(steps)}. Answer: {got}"
  return None


REJECTED_KINDS = ("operand", "mixed")
"""``arithmetic_pairs(rejected=...)``: ``operand`` — every rejected answer solves a question with one operand
moved (the first attempt's pairs); ``mixed`` — half of them that, half the right question with one step's
arithmetic wrong (:func:`_slipped_answer`), the two error kinds a worked answer has."""


def _parse_expression(expr: str) -> tuple[list[int], list[str]]:
  numbers, ops, cur = [], [], ""
  for ch in expr:
    if ch in "+-*" and cur:
      numbers.append(int(cur))
      ops.append(ch)
      cur = ""
    else:
      cur += ch
  numbers.append(int(cur))
  return numbers, ops


def arithmetic_pairs(n: int, *, split: str, seed: int, task: data_lib.ArithmeticConfig,
                     rejected: str = "operand") -> list[dict[str, Any]]:
  """``n`` built-in pairs: an arithmetic question, its correct worked answer (chosen) and a wrong worked
  answer (rejected, :data:`REJECTED_KINDS`: the steps copy a wrong operand, or one step's result is wrong;
  the final answer is wrong either way). Train and held-out questions are disjoint (the task's split)."""
  if rejected not in REJECTED_KINDS:
    raise ValueError(f"rejected must be one of {REJECTED_KINDS}, got {rejected!r}")
  records = data_lib.generate_arithmetic(n, seed=seed, split=split, config=task, format="prompt_completion",
                                         unique=split == "heldout")
  rng = np.random.default_rng([seed, 7])
  out = []
  for r in records:
    numbers, ops = _parse_expression(r["prompt"].removesuffix("=?"))
    wrong = None
    if rejected == "mixed" and ops and rng.random() < 0.5:
      wrong = _slipped_answer(rng, numbers, ops, int(r["answer"]))
    wrong = wrong or _wrong_answer(rng, numbers, ops, int(r["answer"]))
    out.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": wrong, "answer": r["answer"]})
  return out


def sampled_pairs(problems: list[dict[str, Any]], records: list[dict[str, Any]], *, seed: int,
                  per_prompt: int = 1) -> list[dict[str, Any]]:
  """On-policy pairs from a model's own samples: for each problem whose ``k`` samples (a record of
  :func:`jaxrl.eval.evaluate`, ``jaxrl eval``'s ``records.jsonl`` with responses) hold both a correct and a wrong
  one, up to ``per_prompt`` pairs ``{"prompt", "chosen", "rejected", "answer"}``: distinct wrong responses, each
  with a correct one (drawn with ``seed``; a correct sample cut off at the token limit is not used). A record
  matches ``problems[line - 1]``.

  Raises:
    ValueError: a record without responses, or whose line is not a problem.
  """
  if per_prompt < 1:
    raise ValueError(f"per_prompt must be >= 1, got {per_prompt}")
  rng = np.random.default_rng([seed, 11])
  out = []
  for rec in records:
    if "responses" not in rec:
      raise ValueError(f"record of line {rec.get('line')} has no responses (jaxrl eval --no-responses?)")
    if not 1 <= rec["line"] <= len(problems):
      raise ValueError(f"record line {rec['line']} is not one of the {len(problems)} problems")
    problem = problems[rec["line"] - 1]
    samples = list(zip(rec["responses"], rec["correct"], rec["finish_reasons"]))
    good = sorted({t for t, ok, why in samples if ok and why != "length"})
    bad = sorted({t for t, ok, _ in samples if not ok})
    if not good or not bad:
      continue
    for wrong in rng.permutation(bad)[:per_prompt]:
      out.append({"prompt": problem["prompt"], "chosen": str(rng.choice(good)), "rejected": str(wrong),
                  "answer": problem["answer"]})
  return out


def write_builtin_pairs(out_dir: Path, builtin: data_lib.BuiltinTask,
                        rejected: str = "operand") -> tuple[Path, Path | None]:
  """Writes ``train.jsonl`` and ``heldout.jsonl`` pairs of the built-in task under ``out_dir``
  (:func:`arithmetic_pairs` with ``rejected``)."""
  kw = {"seed": builtin.seed, "task": builtin.task, "rejected": rejected}
  train = arithmetic_pairs(builtin.n_train, split="train", **kw)
  train_path = data_lib.write_jsonl(train, out_dir / "train.jsonl")
  if not builtin.n_heldout:
    return train_path, None
  heldout = arithmetic_pairs(builtin.n_heldout, split="heldout", **kw)
  return train_path, data_lib.write_jsonl(heldout, out_dir / "heldout.jsonl")


def pack_sequences(seqs: list[dict[str, np.ndarray]], placed: list[list[int]], *, rows: int, seq_len: int,
                   pad_id: int = 0) -> dict[str, np.ndarray]:
  """The :data:`PAIR_KEYS` arrays ``[rows, seq_len]`` of sequences ``seqs`` (``tokens``, ``loss_mask`` [L]
  each) placed in rows as ``placed`` says (:func:`jaxrl.data.assign_rows`); ``seq_ids`` is ``j + 1`` on
  sequence ``j``, 0 on padding."""
  out = {k: np.zeros((rows, seq_len), np.int32) for k in PAIR_KEYS}
  out["tokens"][:] = pad_id
  out["targets"][:] = pad_id
  out["loss_mask"] = np.zeros((rows, seq_len), np.float32)
  for r, members in enumerate(placed):
    o = 0
    for seg, j in enumerate(members, start=1):
      tok = np.asarray(seqs[j]["tokens"], np.int32)  # [L]
      length = len(tok)
      out["tokens"][r, o:o + length] = tok
      out["targets"][r, o:o + length - 1] = tok[1:]
      out["positions"][r, o:o + length] = np.arange(length)
      out["segment_ids"][r, o:o + length] = seg
      out["loss_mask"][r, o:o + length - 1] = np.asarray(seqs[j]["loss_mask"], bool)[1:]
      out["seq_ids"][r, o:o + length] = j + 1
      o += length
  return out


def packed_batches(seqs: list[dict[str, np.ndarray]], *, rows: int, seq_len: int, pad_id: int = 0):
  """Yields ``[rows, seq_len]`` host arrays (:func:`pack_sequences`) of ``seqs`` placed best-fit, batch after
  batch, until every sequence is in one: how the reward model and the implicit PRM score many sequences."""
  placed = data_lib.assign_rows([len(s["tokens"]) for s in seqs], seq_len, method="best_fit")
  for lo in range(0, len(placed), rows):
    yield pack_sequences(seqs, placed[lo:lo + rows], rows=rows, seq_len=seq_len, pad_id=pad_id)


def pack_pairs(pairs: list[Pair], *, rows: int, seq_len: int, method: str, pad_id: int = 0) -> dict[str, np.ndarray]:
  """The :data:`PAIR_KEYS` arrays ``[rows, seq_len]`` of ``pairs`` (module docstring), plus per-pair
  ``chosen_lengths`` and ``rejected_lengths`` (scored tokens) and ``margins`` (:attr:`Pair.margin`) ``[P]``.

  Raises:
    DataError: when the ``2P`` sequences do not fit in ``rows`` rows.
  """
  seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
  placed = data_lib.assign_rows([len(s["tokens"]) for s in seqs], seq_len, method=method)
  if len(placed) > rows:
    raise data_lib.DataError(f"{len(pairs)} pairs need {len(placed)} rows of {seq_len} tokens, the batch has "
                             f"{rows}; raise packing.global_rows or lower batch.pairs", reason="batch overflow")
  out = pack_sequences(seqs, placed, rows=rows, seq_len=seq_len, pad_id=pad_id)
  scored = [int(np.sum(np.asarray(s["loss_mask"], bool)[1:])) for s in seqs]
  out["chosen_lengths"] = np.asarray(scored[0::2], np.float32)
  out["rejected_lengths"] = np.asarray(scored[1::2], np.float32)
  out["margins"] = np.asarray([p.margin for p in pairs], np.float32)
  out["desirable"] = np.asarray([p.desirable for p in pairs], np.float32)
  return out


def pair_batch(pairs: list[Pair | None], *, micro_batches: int, rows: int, seq_len: int, method: str,
               pad_id: int = 0) -> dict[str, np.ndarray]:
  """A global batch: each of the ``micro_batches`` equal slices of ``pairs`` packed into its own
  ``rows / micro_batches`` rows (:func:`pack_pairs`), concatenated. ``None`` entries are padding pairs
  (``pair_valid`` 0, a one-token stand-in that scores nothing)."""
  filler = Pair({"tokens": np.asarray([pad_id, pad_id], np.int32), "loss_mask": np.zeros(2, bool)},
                {"tokens": np.asarray([pad_id, pad_id], np.int32), "loss_mask": np.zeros(2, bool)}, "padding")
  per_pairs, per_rows = len(pairs) // micro_batches, rows // micro_batches
  parts = []
  for m in range(micro_batches):
    chunk = pairs[m * per_pairs:(m + 1) * per_pairs]
    part = pack_pairs([p or filler for p in chunk], rows=per_rows, seq_len=seq_len, method=method, pad_id=pad_id)
    part["pair_valid"] = np.asarray([p is not None for p in chunk], np.float32)
    parts.append(part)
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class PairStream:
  """Pair indices of ``n`` pairs, epoch after epoch, each epoch in its own seeded order; the state is one
  integer (pairs drawn so far), so a resumed run draws exactly what the uninterrupted one would."""

  def __init__(self, n: int, *, seed: int):
    self.n, self.seed, self.pos = n, seed, 0
    self._epoch, self._order = -1, None

  def take(self, k: int) -> list[int]:
    """The next ``k`` indices."""
    out = []
    for _ in range(k):
      epoch, i = divmod(self.pos, self.n)
      if epoch != self._epoch:
        self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
      out.append(int(self._order[i]))
      self.pos += 1
    return out

  def get_state(self) -> dict[str, int]:
    return {"pos": self.pos}

  def set_state(self, state: dict[str, int]) -> None:
    self.pos = int(state["pos"])
