"""Sequence packing: tokenised samples into fixed-length rows, then fixed-size batches of rows.

A row holds whole samples back to back. For a sample of length ``L`` placed at offset ``o``:

  tokens[o:o+L]      = sample tokens
  targets[o+t]       = tokens[o+t+1] for t < L-1; the last token of a sample has no target (pad)
  loss_mask[o+t]     = the sample's token mask at t+1 (so a loss at position t trains token t+1)
  positions[o:o+L]   = 0, 1, ..., L-1
  segment_ids[o:o+L] = 1, 2, ... per sample in the row; 0 is padding
  sample_ids, turn_ids: unique within the batch; 0 on padding / where there is no loss

Samples are packed in chunks of ``buffer_size``: a chunk is read, its samples are placed with the
configured method, its rows are emitted. Iterator state is therefore small and exact: the upstream
state at the start of the current chunk plus the number of its rows already emitted; restoring
re-reads and re-packs the chunk (packing is deterministic) and skips those rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import grain
import numpy as np

from jaxrl.data._skips import MAX_EXAMPLES

PACKING_METHODS = ("best_fit", "first_fit_decreasing", "none")
ROW_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "sample_ids", "turn_ids")
"""The ``[rows, seq_len]`` arrays of a packed batch (``loss_mask`` is float32, the rest int32)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingConfig:
  """How tokenised samples become ``[global_rows, seq_len]`` batches."""

  seq_len: int = 512
  "Tokens per row."
  method: Literal["best_fit", "first_fit_decreasing", "none"] = "best_fit"
  "``best_fit``: each sample, in arrival order, goes to the fullest row it fits; "
  "``first_fit_decreasing``: longest first, each to the first row it fits; ``none``: one per row."
  buffer_size: int = 256
  "Samples packed together (a larger buffer packs tighter)."
  overlong: Literal["truncate", "drop"] = "truncate"
  "Samples longer than ``seq_len``: keep the first ``seq_len`` tokens, or drop them (counted)."
  global_rows: int = 8
  "Rows per global batch (split evenly over JAX processes)."
  drop_remainder: bool = False
  "At the end of the data, drop a partial batch instead of padding it with empty rows."

  def __post_init__(self):
    if self.seq_len < 2:
      raise ValueError(f"seq_len must be >= 2, got {self.seq_len!r}")
    if self.method not in PACKING_METHODS:
      raise ValueError(f"method must be one of {list(PACKING_METHODS)}, got {self.method!r}")
    if self.buffer_size < 1:
      raise ValueError(f"buffer_size must be >= 1, got {self.buffer_size!r}")
    if self.overlong not in ("truncate", "drop"):
      raise ValueError(f"overlong must be 'truncate' or 'drop', got {self.overlong!r}")
    if self.global_rows < 1:
      raise ValueError(f"global_rows must be >= 1, got {self.global_rows!r}")


def assign_rows(lengths: Sequence[int], seq_len: int, *, method: str) -> list[list[int]]:
  """Bin packing: which samples (indices into ``lengths``) go into each row, in row order.

  Args:
    lengths: sample lengths, each in ``[1, seq_len]``.
    seq_len: row capacity.
    method: one of :data:`PACKING_METHODS`.

  Returns:
    A list of rows, each a list of sample indices in placement order.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and (lengths.min() < 1 or lengths.max() > seq_len):
    raise ValueError(f"sample lengths must be in [1, {seq_len}], got {lengths.min()}..{lengths.max()}")
  if method == "none":
    return [[i] for i in range(len(lengths))]
  if method == "first_fit_decreasing":
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  elif method == "best_fit":
    order = range(len(lengths))
  else:
    raise ValueError(f"method must be one of {list(PACKING_METHODS)}, got {method!r}")
  free = np.zeros(len(lengths), np.int64)  # remaining capacity per open row
  rows: list[list[int]] = []
  for i in order:
    fits = free[:len(rows)] >= lengths[i]
    if not fits.any():
      rows.append([])
      r = len(rows) - 1
      free[r] = seq_len
    elif method == "best_fit":
      r = int(np.argmin(np.where(fits, free[:len(rows)], seq_len + 1)))
    else:
      r = int(np.argmax(fits))
    rows[r].append(i)
    free[r] -= lengths[i]
  return rows


def fit_sample(sample: dict[str, np.ndarray], seq_len: int, *, overlong: str):
  """Applies the overlong policy; returns ``(sample or None, status)``.

  ``status`` is ``"ok"``, ``"truncated"`` or ``"dropped"``. A sample is also dropped when it has no
  trained target left (no loss token after its first token), e.g. after truncation.
  """
  status = "ok"
  if len(sample["tokens"]) > seq_len:
    if overlong == "drop":
      return None, "dropped"
    sample = {k: v[:seq_len] for k, v in sample.items()}
    status = "truncated"
  if not np.any(sample["loss_mask"][1:]):
    return None, "dropped"
  return sample, status


def pack_samples(samples: Sequence[dict[str, np.ndarray]], seq_len: int, *, method: str,
                 pad_id: int = 0) -> dict[str, np.ndarray]:
  """Packs samples (each no longer than ``seq_len``) into rows.

  Args:
    samples: dicts with ``tokens``, ``loss_mask`` and ``turn_id``, each [L] (token-aligned, as
      from :func:`jaxrl.data.encode_record`).
    seq_len: row length.
    method: one of :data:`PACKING_METHODS`.
    pad_id: token id of padding and of positions without a target.

  Returns:
    The :data:`ROW_KEYS` arrays, [R, seq_len], with row-local ``sample_ids`` (= ``segment_ids``)
    and row-local ``turn_ids``; plus ``num_samples`` and ``num_turns`` [R].
  """
  rows = assign_rows([len(s["tokens"]) for s in samples], seq_len, method=method)
  n = len(rows)
  out = {k: np.zeros((n, seq_len), np.int32) for k in ROW_KEYS}
  out["tokens"][:] = pad_id
  out["targets"][:] = pad_id
  out["loss_mask"] = np.zeros((n, seq_len), np.float32)
  num_samples = np.zeros(n, np.int32)
  num_turns = np.zeros(n, np.int32)
  for r, members in enumerate(rows):
    o, turn_base = 0, 0
    for seg, i in enumerate(members, start=1):
      tok = np.asarray(samples[i]["tokens"], np.int32)  # [L]
      mask = np.asarray(samples[i]["loss_mask"], bool)[1:]  # [L-1], aligned to targets
      turn = np.asarray(samples[i]["turn_id"], np.int32)[1:]  # [L-1]
      length = len(tok)
      out["tokens"][r, o:o + length] = tok
      out["targets"][r, o:o + length - 1] = tok[1:]
      out["positions"][r, o:o + length] = np.arange(length)
      out["segment_ids"][r, o:o + length] = seg
      out["sample_ids"][r, o:o + length] = seg
      out["loss_mask"][r, o:o + length - 1] = mask
      out["turn_ids"][r, o:o + length - 1] = np.where(mask & (turn > 0), turn + turn_base, 0)
      turn_base += int(turn.max(initial=0))
      o += length
    num_samples[r] = len(members)
    num_turns[r] = turn_base
  out["num_samples"] = num_samples
  out["num_turns"] = num_turns
  return out


class _Counters(NamedTuple):
  samples: int = 0
  truncated: int = 0
  dropped: int = 0
  truncated_ids: tuple[int, ...] = ()  # source indices of the first few distinct truncated samples
  dropped_ids: tuple[int, ...] = ()


def _source_index(sample: dict[str, np.ndarray]) -> int | None:
  """The record's source index (``sample_id``, from :func:`jaxrl.data.encode_record`), if the sample has one."""
  ids = sample.get("sample_id")
  return int(ids[0]) if ids is not None and len(ids) else None


def _note(ids: tuple[int, ...], index: int | None) -> tuple[int, ...]:
  """``ids`` plus ``index`` while fewer than :data:`MAX_EXAMPLES` distinct ones are kept."""
  return ids if index is None or index in ids or len(ids) >= MAX_EXAMPLES else (*ids, index)


class _PackedRowsIterator(grain.DatasetIterator):
  """Reads ``buffer_size`` samples, packs them, emits their rows one by one."""

  def __init__(self, parent: grain.DatasetIterator, config: PackingConfig, pad_id: int):
    super().__init__(parent)
    self._config = config
    self._pad_id = pad_id
    self._chunk_state = parent.get_state()
    self._chunk_counters = _Counters()
    self._counters = _Counters()
    self._rows: dict[str, np.ndarray] | None = None
    self._emitted = 0
    self._exhausted = False

  def _fill(self) -> None:
    cfg = self._config
    self._chunk_state = self._parent.get_state()
    self._chunk_counters = self._counters
    self._emitted = 0
    samples = []
    seen, truncated, dropped, truncated_ids, dropped_ids = self._counters
    while len(samples) < cfg.buffer_size:
      try:
        sample = next(self._parent)
      except StopIteration:
        self._exhausted = True
        break
      seen += 1
      index = _source_index(sample)
      sample, status = fit_sample(sample, cfg.seq_len, overlong=cfg.overlong)
      if status == "truncated":
        truncated, truncated_ids = truncated + 1, _note(truncated_ids, index)
      elif status == "dropped":
        dropped, dropped_ids = dropped + 1, _note(dropped_ids, index)
      if sample is not None:
        samples.append(sample)
    self._counters = _Counters(seen, truncated, dropped, truncated_ids, dropped_ids)
    self._rows = pack_samples(samples, cfg.seq_len, method=cfg.method, pad_id=self._pad_id)

  def __next__(self) -> dict[str, Any]:
    while self._rows is None or self._emitted >= len(self._rows["tokens"]):
      if self._exhausted:
        raise StopIteration
      self._fill()
    r = self._emitted
    self._emitted += 1
    row = {k: v[r] for k, v in self._rows.items()}
    row.update(self._counters._asdict())
    return row

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._chunk_state, "emitted": self._emitted,
            "counters": list(self._chunk_counters)}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    counts = state["counters"]  # the id lists come back from JSON as lists (absent in older checkpoints)
    self._counters = _Counters(*counts[:3], *(tuple(int(i) for i in ids) for ids in counts[3:]))
    self._exhausted = False
    self._rows = None
    if state["emitted"]:
      self._fill()
      self._emitted = state["emitted"]
    else:
      self._chunk_state = state["parent"]
      self._chunk_counters = self._counters


class PackedRowsIterDataset(grain.IterDataset):
  """Grain dataset of packed rows: each element is a dict of [seq_len] arrays (see module doc).

  Elements also carry ``num_samples``/``num_turns`` (this row) and cumulative ``samples``,
  ``truncated`` and ``dropped`` counts of the samples read so far, with ``truncated_ids`` /
  ``dropped_ids``: the source indices (``sample_id``) of the first few distinct such samples.
  """

  def __init__(self, parent: grain.IterDataset, *, config: PackingConfig, pad_id: int = 0):
    super().__init__(parent)
    self._config = config
    self._pad_id = pad_id

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedRowsIterator(self._parent.__iter__(), self._config, self._pad_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingStats:
  """Per-batch packing report (the cumulative counts cover all samples read so far)."""

  rows: int
  "Rows in the batch (including empty rows padding the last batch)."
  samples: int
  "Samples in the batch."
  tokens: int
  "Non-padding tokens in the batch."
  loss_tokens: int
  "Tokens with a loss (``loss_mask`` sum)."
  efficiency: float
  "Non-padding fraction, ``tokens / (rows * seq_len)``."
  samples_read: int
  "Cumulative samples read from upstream."
  truncated: int
  "Cumulative samples truncated to ``seq_len``."
  dropped: int
  "Cumulative samples dropped (overlong under ``drop``, or nothing left to train)."
  truncated_examples: tuple[int, ...] = ()
  "Source indices (records' ``_index``; ``source.where(i)``: ``file:line``) of the first few truncated samples."
  dropped_examples: tuple[int, ...] = ()
  "The same for dropped samples."


class PackedBatch(NamedTuple):
  """One batch: ``arrays`` (:data:`ROW_KEYS`, each [rows, seq_len]) and its :class:`PackingStats`."""

  arrays: dict[str, np.ndarray]
  stats: PackingStats


def stack_rows(rows: Sequence[dict[str, Any]], *, num_rows: int, seq_len: int, pad_id: int = 0,
               id_offset: int = 0) -> PackedBatch:
  """Stacks packed rows into a batch, padding to ``num_rows`` with empty rows.

  Row-local ``sample_ids`` and ``turn_ids`` are offset so that they are unique within the batch
  (dense from ``id_offset + 1``); 0 stays 0.
  """
  pad = num_rows - len(rows)
  if pad < 0:
    raise ValueError(f"got {len(rows)} rows for a batch of num_rows={num_rows}")
  arrays = {}
  for k in ROW_KEYS:
    dtype = np.float32 if k == "loss_mask" else np.int32
    fill = pad_id if k in ("tokens", "targets") else 0
    parts = [np.stack([row[k] for row in rows]).astype(dtype, copy=False)] if rows else []
    arrays[k] = np.concatenate(parts + [np.full((pad, seq_len), fill, dtype)])
  ns = np.asarray([row["num_samples"] for row in rows] + [0] * pad, np.int32)
  nt = np.asarray([row["num_turns"] for row in rows] + [0] * pad, np.int32)
  s_off = (np.cumsum(ns) - ns + id_offset)[:, None]  # [R, 1]
  t_off = (np.cumsum(nt) - nt + id_offset)[:, None]  # [R, 1]
  arrays["sample_ids"] = np.where(arrays["sample_ids"] > 0, arrays["sample_ids"] + s_off, 0).astype(np.int32)
  arrays["turn_ids"] = np.where(arrays["turn_ids"] > 0, arrays["turn_ids"] + t_off, 0).astype(np.int32)
  tokens = int(np.sum(arrays["segment_ids"] > 0))
  last = rows[-1] if rows else {"samples": 0, "truncated": 0, "dropped": 0}
  stats = PackingStats(
      rows=num_rows, samples=int(ns.sum()), tokens=tokens,
      loss_tokens=int(arrays["loss_mask"].sum()), efficiency=tokens / (num_rows * seq_len),
      samples_read=int(last["samples"]), truncated=int(last["truncated"]),
      dropped=int(last["dropped"]), truncated_examples=tuple(last.get("truncated_ids", ())),
      dropped_examples=tuple(last.get("dropped_ids", ())))
  return PackedBatch(arrays, stats)


class _PackedBatchIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, *, num_rows: int, config: PackingConfig,
               pad_id: int, id_offset: int):
    super().__init__(parent)
    self._num_rows = num_rows
    self._config = config
    self._pad_id = pad_id
    self._id_offset = id_offset
    self._batches = 0

  def __next__(self) -> PackedBatch:
    rows = []
    for _ in range(self._num_rows):
      try:
        rows.append(next(self._parent))
      except StopIteration:
        break
    if not rows or (len(rows) < self._num_rows and self._config.drop_remainder):
      raise StopIteration
    self._batches += 1
    return stack_rows(rows, num_rows=self._num_rows, seq_len=self._config.seq_len,
                      pad_id=self._pad_id, id_offset=self._id_offset)

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._parent.get_state(), "batches": self._batches}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._batches = state["batches"]


class PackedBatchIterDataset(grain.IterDataset):
  """Grain dataset of :class:`PackedBatch` es of ``num_rows`` packed rows each.

  Args:
    parent: a dataset of tokenised samples (dicts with ``tokens``, ``loss_mask``, ``turn_id``).
    config: packing settings.
    pad_id: padding token id.
    num_rows: rows per yielded batch; default ``config.global_rows`` (one process). Each process
      passes its share, ``global_rows // process_count``.
    id_offset: added to ``sample_ids``/``turn_ids`` so that ids stay unique when processes'
      batches are joined into one global batch (e.g. ``process_index * num_rows * seq_len``).
  """

  def __init__(self, parent: grain.IterDataset, *, config: PackingConfig, pad_id: int = 0,
               num_rows: int | None = None, id_offset: int = 0):
    super().__init__(PackedRowsIterDataset(parent, config=config, pad_id=pad_id))
    self._config = config
    self._pad_id = pad_id
    self._num_rows = config.global_rows if num_rows is None else num_rows
    self._id_offset = id_offset

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedBatchIterator(self._parent.__iter__(), num_rows=self._num_rows,
                                config=self._config, pad_id=self._pad_id, id_offset=self._id_offset)
