"""The judge's persistent response cache: one SQLite table from request hash to `JudgeResponse`.

A key is the SHA-256 of the request (base URL or launched model directory, endpoint, model and body;
never the API key), so a repeated request costs nothing and a restarted run re-reads its answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sqlite3
import threading
from typing import Any

from jaxrl.rewards._judge_parse import JudgeResponse

__all__ = ["ResponseCache", "request_key"]


def request_key(*parts: Any) -> str:
  """The cache key of a request: SHA-256 of its parts as sorted-key JSON."""
  return hashlib.sha256(json.dumps(list(parts), sort_keys=True).encode()).hexdigest()


class ResponseCache:
  """A thread-safe SQLite store of judge responses at ``path``; ``path=None`` stores nothing."""

  def __init__(self, path: str | None):
    self._lock = threading.Lock()
    self._db = None
    if path:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      self._db = sqlite3.connect(path, check_same_thread=False)
      self._db.execute("CREATE TABLE IF NOT EXISTS judge (key TEXT PRIMARY KEY, value TEXT)")
      self._db.commit()

  def get(self, key: str) -> JudgeResponse | None:
    """The stored response for ``key``, or None."""
    if self._db is None:
      return None
    with self._lock:
      row = self._db.execute("SELECT value FROM judge WHERE key = ?", (key,)).fetchone()
    return None if row is None else JudgeResponse(**json.loads(row[0]))

  def put(self, key: str, resp: JudgeResponse) -> None:
    """Stores ``resp`` under ``key`` (replacing any earlier one) and commits."""
    if self._db is None:
      return
    with self._lock:
      self._db.execute("INSERT OR REPLACE INTO judge VALUES (?, ?)", (key, json.dumps(dataclasses.asdict(resp))))
      self._db.commit()
