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
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ROLES = ("system", "user", "assistant", "tool")
_MAX_LISTED = 5


class DataError(ValueError):
  """A data file or record is unusable; the message names ``file:line`` where it can.

  ``reason`` is a short category (``malformed JSON``, ``missing field``, ...) for the skip report.
  """

  def __init__(self, message: str, *, reason: str = "invalid record"):
    super().__init__(message)
    self.reason = reason


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
    raise DataError(f"record must be a JSON object, got {type(record).__name__}", reason="not a JSON object")
  if "messages" in record:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
      raise DataError("'messages' must be a non-empty list", reason="wrong type")
    for i, m in enumerate(messages):
      _check_message(m, f"messages[{i}]")
    trained = [m for m in messages if m["role"] == "assistant" and m.get("train", True)]
    if not trained:
      raise DataError("'messages' has no trained assistant turn", reason="no trained assistant turn")
    if messages[0]["role"] == "assistant" and messages[0].get("train", True):
      raise DataError("messages[0] is a trained assistant turn; a system or user message must "
                      "come first", reason="bad chat order")
    for i, m in enumerate(messages):
      if m["role"] == "assistant" and m.get("train", True) and not m["content"]:
        raise DataError(f"messages[{i}] is a trained assistant turn with empty content",
                        reason="empty completion")
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True))
    if not any(m["content"].strip() for m in messages[:first]):
      raise DataError(f"the messages before the first trained turn (messages[{first}]) are all empty",
                      reason="empty prompt")
    return messages
  if "prompt" in record or "completion" in record:
    for key in ("prompt", "completion"):
      if key not in record:
        raise DataError(f"missing field {key!r} (a prompt/completion record needs both)",
                        reason="missing field")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str):
      if not prompt.strip():
        raise DataError("'prompt' is empty", reason="empty prompt")
      prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
      for i, m in enumerate(prompt):
        _check_message(m, f"prompt[{i}]")
      if not any(m["content"].strip() for m in prompt):
        raise DataError("'prompt' has only empty messages", reason="empty prompt")
    else:
      raise DataError("'prompt' must be a string or a non-empty list of messages", reason="wrong type")
    if not isinstance(completion, str):
      raise DataError(f"'completion' must be a string, got {type(completion).__name__}", reason="wrong type")
    if not completion:
      raise DataError("'completion' is empty", reason="empty completion")
    return list(prompt) + [{"role": "assistant", "content": completion}]
  raise DataError(f"record needs 'messages' or 'prompt'/'completion'; has keys {sorted(record)}",
                  reason="missing field")


def _check_message(m: Any, where: str) -> None:
  if not isinstance(m, dict):
    raise DataError(f"{where} must be an object, got {type(m).__name__}", reason="wrong type")
  for key in ("role", "content"):
    if key not in m:
      raise DataError(f"{where} is missing field {key!r}", reason="missing field")
  if m["role"] not in _ROLES:
    raise DataError(f"{where}.role must be one of {list(_ROLES)}, got {m['role']!r}", reason="unknown role")
  if not isinstance(m["content"], str):
    raise DataError(f"{where}.content must be a string, got {type(m['content']).__name__}",
                    reason="wrong type")
  if "train" in m and not isinstance(m["train"], bool):
    raise DataError(f"{where}.train must be true or false, got {m['train']!r}", reason="wrong type")


class _BadRecords:
  """Counts skipped records and raises once the budget is exceeded (after the full scan)."""

  def __init__(self, max_bad_records: int):
    if max_bad_records < 0:
      raise ValueError(f"max_bad_records must be >= 0, got {max_bad_records!r}")
    self.max_bad_records = max_bad_records
    self.items: list[tuple[str, str]] = []
    self.reasons: list[tuple[str, str, str]] = []  # (file:line, reason category, message)

  def add(self, where: str, error: DataError) -> None:
    self.items.append((where, str(error)))
    self.reasons.append((where, error.reason, str(error)))

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
    raise DataError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                    reason="not UTF-8") from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"malformed JSON: {e.msg} at column {e.colno}", reason="malformed JSON") from None


class JsonlSource:
  """Grain random-access source over the valid records of one or more JSONL files.

  ``source[i]`` is the record dict plus ``"_where"`` (``"file:line"``) and ``"_index"`` (``i``).
  Blank lines are ignored; ``validate(record)`` (default :func:`record_messages`) raising :class:`DataError`
  marks a bad record. Attributes ``num_bad``, ``bad_records`` (``(file:line, message)`` pairs)
  and ``bad_reasons`` (``(file:line, reason, message)``) report what was skipped.

  Each file's size, modification time and CRC-32 are recorded while it is indexed: a read after the
  file changed raises a :class:`DataError` naming it (the offsets no longer point at the indexed
  records), and :meth:`fingerprint` lets a resumed run check that it reads the same bytes.
  """

  def __init__(self, paths: str | Path | Sequence[str | Path], *, max_bad_records: int = 0,
               validate: Callable[[Any], Any] = record_messages):
    self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not self.paths:
      raise DataError("JsonlSource needs at least one file")
    bad = _BadRecords(max_bad_records)
    file_idx, offsets, lengths, lines = [], [], [], []
    self._stats: list[tuple[int, int, int]] = []  # per file: (bytes, mtime_ns, crc32) when indexed
    for fi, path in enumerate(self.paths):
      if not path.is_file():
        raise DataError(f"data file not found: {path}")
      offset, crc = 0, 0
      with path.open("rb") as f:
        st = os.fstat(f.fileno())
        for lineno, raw in enumerate(f, start=1):
          start, offset = offset, offset + len(raw)
          crc = zlib.crc32(raw, crc)
          if not raw.strip():
            continue
          try:
            validate(_parse_line(raw))
          except DataError as e:
            bad.add(f"{path}:{lineno}", e)
            continue
          file_idx.append(fi)
          offsets.append(start)
          lengths.append(len(raw))
          lines.append(lineno)
      if offset != st.st_size or os.stat(path).st_mtime_ns != st.st_mtime_ns:
        raise DataError(f"{path}: data file changed while it was being indexed; rerun once it is complete")
      self._stats.append((offset, st.st_mtime_ns, crc))
    bad.check()
    self.bad_records = bad.items
    self.bad_reasons = bad.reasons
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
    st = os.fstat(fd)
    size, mtime_ns, _ = self._stats[fi]
    if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
      raise DataError(f"{self.paths[fi]}: data file changed after it was indexed ({size} bytes, now "
                      f"{st.st_size}; modified since); its records no longer match the index. Restart "
                      "the run (a resumed run checks the file's checksum)", reason="file changed")
    raw = os.pread(fd, int(self._lengths[index]), int(self._offsets[index]))
    record = _parse_line(raw)
    return {**record, "_where": self.where(index), "_index": index}

  def fingerprint(self) -> dict[str, list[int]]:
    """``{file: [bytes, crc32]}`` of the indexed contents (for :func:`check_fingerprint`)."""
    return {str(p): [size, crc] for p, (size, _, crc) in zip(self.paths, self._stats)}

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

  def __init__(self, paths: str | Path | Sequence[str | Path], *, max_bad_records: int = 0,
               validate: Callable[[Any], Any] = record_messages):
    try:
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("ParquetSource needs the 'pyarrow' package, which is not installed; "
                        "install pyarrow or convert the data to JSONL") from e
    self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    bad = _BadRecords(max_bad_records)
    self._records: list[dict[str, Any]] = []
    self._where: list[str] = []
    self._fingerprint: dict[str, list[int]] = {}
    for path in self.paths:
      if not path.is_file():
        raise DataError(f"data file not found: {path}")
      blob = path.read_bytes()
      self._fingerprint[str(path)] = [len(blob), zlib.crc32(blob)]
      for row, record in enumerate(pq.read_table(path).to_pylist(), start=1):
        where = f"{path}:row {row}"
        try:
          validate(record)
        except DataError as e:
          bad.add(where, e)
          continue
        self._records.append(record)
        self._where.append(where)
    bad.check()
    self.bad_records = bad.items
    self.bad_reasons = bad.reasons
    self.num_bad = len(bad.items)

  def __len__(self) -> int:
    return len(self._records)

  def where(self, index: int) -> str:
    return self._where[index]

  def fingerprint(self) -> dict[str, list[int]]:
    """``{file: [bytes, crc32]}`` of the files read (for :func:`check_fingerprint`)."""
    return dict(self._fingerprint)

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = int(index)
    return {**self._records[index], "_where": self._where[index], "_index": index}


def check_fingerprint(saved: dict[str, list[int]] | None, current: dict[str, list[int]]) -> None:
  """Raises :class:`DataError` naming the first data file whose bytes differ from ``saved`` (the
  fingerprint stored with a checkpoint), since the saved data position would point at other records.

  Files are matched in order, not by name, so a run directory or data set that moved still resumes.
  """
  if not saved:
    return
  if len(saved) != len(current):
    raise DataError(f"the checkpoint was written while training on {len(saved)} data file(s) "
                    f"({sorted(saved)}); this run reads {len(current)} ({sorted(current)})",
                    reason="file changed")
  for (old_path, (size, crc)), (path, now) in zip(saved.items(), current.items()):
    if list(now) != [size, crc]:
      was = "" if old_path == path else f" (was {old_path})"
      raise DataError(f"{path}: data file changed since the checkpoint was written{was} ({size} bytes, "
                      f"CRC-32 {crc:08x}; now {now[0]} bytes, CRC-32 {now[1]:08x}); the saved data "
                      "position would point at other records. Restore the file or start a new out_dir",
                      reason="file changed")


def open_source(paths: str | Path | Sequence[str | Path], *, format: str = "auto",  # noqa: A002
                max_bad_records: int = 0, validate: Callable[[Any], Any] = record_messages) -> JsonlSource | ParquetSource:
  """A :class:`JsonlSource` or :class:`ParquetSource`; ``auto`` picks by file suffix. ``validate(record)`` raises
  :class:`DataError` for a record to skip (default :func:`record_messages`; records with images:
  :func:`jaxrl.data.vl_record_messages`, which checks image parts without loading the images)."""
  paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
  if format == "auto":
    kinds = {"parquet" if p.suffix == ".parquet" else "jsonl" for p in paths}
    if len(kinds) != 1:
      raise DataError(f"cannot mix Parquet and JSONL files in one source: {[str(p) for p in paths]}")
    (format,) = kinds
  if format == "jsonl":
    return JsonlSource(paths, max_bad_records=max_bad_records, validate=validate)
  if format == "parquet":
    return ParquetSource(paths, max_bad_records=max_bad_records, validate=validate)
  raise DataError(f"format must be 'auto', 'jsonl' or 'parquet', got {format!r}")
