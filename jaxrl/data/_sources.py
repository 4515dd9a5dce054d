"""Local record sources (JSONL, Parquet) for Grain, with validation and a bad-record budget.

A source reads every record once when it is built: it checks that the bytes are UTF-8, the line is
JSON, and the record has a trainable shape (see :func:`record_messages`). Bad records are skipped
and counted while their count stays within ``max_bad_records``; past it the source raises a
:class:`DataError` naming the count and the first offenders as ``file:line``. Afterwards the source
is a Grain random-access data source (``len`` and ``[i]``) over the good records, which it reads
back lazily from the file (JSONL) so that memory holds offsets, not records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ROLES = ("system", "user", "assistant", "tool")
_MAX_LISTED = 5


class DataError(ValueError):
  """A data file or record is unusable; the message names ``file:line`` where it can."""


def record_messages(record: Any) -> list[dict[str, Any]]:
  """Validates one record and returns it as a list of chat messages.

  A record is either ``{"messages": [{"role", "content", "train"?}, ...]}`` (assistant turns are
  trained unless ``"train": false``) or ``{"prompt": str | messages, "completion": str}`` (the
  prompt becomes the user turn(s), the completion the one trained assistant turn). Other keys
  (e.g. ``answer``) are ignored.

  Raises:
    DataError: naming the missing or malformed field.
  """
  if not isinstance(record, dict):
    raise DataError(f"record must be a JSON object, got {type(record).__name__}")
  if "messages" in record:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
      raise DataError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
      _check_message(m, f"messages[{i}]")
    trained = [m for m in messages if m["role"] == "assistant" and m.get("train", True)]
    if not trained:
      raise DataError("'messages' has no trained assistant turn")
    if messages[0]["role"] == "assistant" and messages[0].get("train", True):
      raise DataError("messages[0] is a trained assistant turn; a system or user message must "
                      "come first")
    for i, m in enumerate(messages):
      if m["role"] == "assistant" and m.get("train", True) and not m["content"]:
        raise DataError(f"messages[{i}] is a trained assistant turn with empty content")
    return messages
  if "prompt" in record or "completion" in record:
    for key in ("prompt", "completion"):
      if key not in record:
        raise DataError(f"missing field {key!r} (a prompt/completion record needs both)")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str):
      prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
      for i, m in enumerate(prompt):
        _check_message(m, f"prompt[{i}]")
    else:
      raise DataError("'prompt' must be a string or a non-empty list of messages")
    if not isinstance(completion, str):
      raise DataError(f"'completion' must be a string, got {type(completion).__name__}")
    if not completion:
      raise DataError("'completion' is empty")
    return list(prompt) + [{"role": "assistant", "content": completion}]
  raise DataError(f"record needs 'messages' or 'prompt'/'completion'; has keys {sorted(record)}")


def _check_message(m: Any, where: str) -> None:
  if not isinstance(m, dict):
    raise DataError(f"{where} must be an object, got {type(m).__name__}")
  for key in ("role", "content"):
    if key not in m:
      raise DataError(f"{where} is missing field {key!r}")
  if m["role"] not in _ROLES:
    raise DataError(f"{where}.role must be one of {list(_ROLES)}, got {m['role']!r}")
  if not isinstance(m["content"], str):
    raise DataError(f"{where}.content must be a string, got {type(m['content']).__name__}")
  if "train" in m and not isinstance(m["train"], bool):
    raise DataError(f"{where}.train must be true or false, got {m['train']!r}")


class _BadRecords:
  """Counts skipped records and raises once the budget is exceeded (after the full scan)."""

  def __init__(self, max_bad_records: int):
    if max_bad_records < 0:
      raise ValueError(f"max_bad_records must be >= 0, got {max_bad_records!r}")
    self.max_bad_records = max_bad_records
    self.items: list[tuple[str, str]] = []

  def add(self, where: str, reason: str) -> None:
    self.items.append((where, reason))

  def check(self) -> None:
    n = len(self.items)
    if n > self.max_bad_records:
      listed = "; ".join(f"{w}: {r}" for w, r in self.items[:_MAX_LISTED])
      more = f" (and {n - _MAX_LISTED} more)" if n > _MAX_LISTED else ""
      raise DataError(f"{n} bad record{'s' if n > 1 else ''} (max_bad_records="
                      f"{self.max_bad_records}): {listed}{more}")


def _parse_line(raw: bytes) -> Any:
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"malformed JSON: {e.msg} at column {e.colno}") from None


class JsonlSource:
  """Grain random-access source over the valid records of one or more JSONL files.

  ``source[i]`` is the record dict plus ``"_where"`` (``"file:line"``) and ``"_index"`` (``i``).
  Blank lines are ignored. Attributes ``num_bad`` and ``bad_records`` (``(file:line, reason)``
  pairs) report what was skipped.
  """

  def __init__(self, paths: str | Path | Sequence[str | Path], *, max_bad_records: int = 0):
    self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not self.paths:
      raise DataError("JsonlSource needs at least one file")
    bad = _BadRecords(max_bad_records)
    file_idx, offsets, lengths, lines = [], [], [], []
    for fi, path in enumerate(self.paths):
      if not path.is_file():
        raise DataError(f"data file not found: {path}")
      offset = 0
      with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
          start, offset = offset, offset + len(raw)
          if not raw.strip():
            continue
          try:
            record_messages(_parse_line(raw))
          except DataError as e:
            bad.add(f"{path}:{lineno}", str(e))
            continue
          file_idx.append(fi)
          offsets.append(start)
          lengths.append(len(raw))
          lines.append(lineno)
    bad.check()
    self.bad_records = bad.items
    self.num_bad = len(bad.items)
    self._file_idx = np.asarray(file_idx, np.int32)
    self._offsets = np.asarray(offsets, np.int64)
    self._lengths = np.asarray(lengths, np.int64)
    self._lines = np.asarray(lines, np.int64)
    self._fds: dict[int, int] = {}

  def __len__(self) -> int:
    return len(self._offsets)

  def where(self, index: int) -> str:
    """``file:line`` of record ``index``."""
    return f"{self.paths[self._file_idx[index]]}:{self._lines[index]}"

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = int(index)
    fi = int(self._file_idx[index])
    fd = self._fds.get(fi)
    if fd is None:
      fd = self._fds[fi] = os.open(self.paths[fi], os.O_RDONLY)
    raw = os.pread(fd, int(self._lengths[index]), int(self._offsets[index]))
    record = _parse_line(raw)
    return {**record, "_where": self.where(index), "_index": index}

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_fds"} | {"_fds": {}}

  def __del__(self):
    for fd in getattr(self, "_fds", {}).values():
      try:
        os.close(fd)
      except OSError:
        pass

  def __repr__(self) -> str:
    return f"JsonlSource({[str(p) for p in self.paths]}, records={len(self)}, bad={self.num_bad})"


class ParquetSource:
  """Grain random-access source over the valid rows of Parquet files (needs ``pyarrow``).

  Rows are records as in :class:`JsonlSource`; ``"_where"`` is ``"file:row N"`` (1-based).
  """

  def __init__(self, paths: str | Path | Sequence[str | Path], *, max_bad_records: int = 0):
    try:
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("ParquetSource needs the 'pyarrow' package, which is not installed; "
                        "install pyarrow or convert the data to JSONL") from e
    self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    bad = _BadRecords(max_bad_records)
    self._records: list[dict[str, Any]] = []
    self._where: list[str] = []
    for path in self.paths:
      if not path.is_file():
        raise DataError(f"data file not found: {path}")
      for row, record in enumerate(pq.read_table(path).to_pylist(), start=1):
        where = f"{path}:row {row}"
        try:
          record_messages(record)
        except DataError as e:
          bad.add(where, str(e))
          continue
        self._records.append(record)
        self._where.append(where)
    bad.check()
    self.bad_records = bad.items
    self.num_bad = len(bad.items)

  def __len__(self) -> int:
    return len(self._records)

  def where(self, index: int) -> str:
    return self._where[index]

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = int(index)
    return {**self._records[index], "_where": self._where[index], "_index": index}


def open_source(paths: str | Path | Sequence[str | Path], *, format: str = "auto",  # noqa: A002
                max_bad_records: int = 0) -> JsonlSource | ParquetSource:
  """A :class:`JsonlSource` or :class:`ParquetSource`; ``auto`` picks by file suffix."""
  paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
  if format == "auto":
    kinds = {"parquet" if p.suffix == ".parquet" else "jsonl" for p in paths}
    if len(kinds) != 1:
      raise DataError(f"cannot mix Parquet and JSONL files in one source: {[str(p) for p in paths]}")
    (format,) = kinds
  if format == "jsonl":
    return JsonlSource(paths, max_bad_records=max_bad_records)
  if format == "parquet":
    return ParquetSource(paths, max_bad_records=max_bad_records)
  raise DataError(f"format must be 'auto', 'jsonl' or 'parquet', got {format!r}")
