"""jaxrl._host_memory.trim: memory freed to malloc goes back to the operating system (issue 34)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from jaxrl import _host_memory

BLOCK = 64 << 10  # below glibc's initial mmap threshold (128 KiB): served from the heap
BLOCKS = 4096  # 256 MiB


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(_host_memory._malloc_trim() is None,
                    reason="malloc_trim is glibc's; elsewhere trim() does nothing (tested below)")
def test_trim_returns_freed_heap_memory_to_the_os():
  """Heap blocks freed below a live one stay resident (free() only trims the heap's top); trim() hands them
  back. Without it the resident set stays where it was."""
  blocks = [np.ones(BLOCK // 8) for _ in range(BLOCKS)]  # touched: resident
  pin = np.ones(BLOCK // 8)  # a live block above them, so free() cannot shrink the heap from the top
  del blocks
  before = _rss_bytes()
  assert _host_memory.trim()
  after = _rss_bytes()
  assert before - after > BLOCK * BLOCKS // 2, (before, after)
  del pin


def test_trim_is_a_no_op_without_malloc_trim(monkeypatch):
  monkeypatch.setattr(sys, "platform", "darwin")
  _host_memory._malloc_trim.cache_clear()
  try:
    assert _host_memory.trim() is False
  finally:
    monkeypatch.undo()
    _host_memory._malloc_trim.cache_clear()
