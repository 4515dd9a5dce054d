"""Handing freed host memory back to the operating system (a leaf: stdlib only).

On the CPU backend an array's buffer comes from the C library's ``malloc``. glibc serves blocks below its
*dynamic* mmap threshold (it rises, up to 32 MiB, each time a larger mapped block is freed) from its heaps,
and memory freed there stays in the process (its resident set) until the top of a heap happens to be free.
A rollout's unstacked copy of the block weights is made of such blocks (one per layer and weight), so after
:meth:`jaxrl.sampling.Sampler.release_weights` a 0.5B model's 1.3 GiB copy was free for ``malloc`` but still
resident through the train step, whose large temporaries are mapped afresh. :func:`trim` asks glibc to return
every free page (``malloc_trim(0)``, which since glibc 2.8 also releases free pages inside a heap), so the
process's peak is the arrays it holds, not the arrays it held. Elsewhere (musl, macOS, Windows) it does
nothing. docs/benchmarks.md, "Memory at the 0.5B workload".
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
  if not sys.platform.startswith("linux"):
    return None
  try:
    fn = ctypes.CDLL(None).malloc_trim  # the process's C library; glibc only
  except (OSError, AttributeError):
    return None
  fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
  return fn


def trim() -> bool:
  """Returns the process's free ``malloc`` memory to the OS; True if the C library released any."""
  fn = _malloc_trim()
  return bool(fn(0)) if fn is not None else False
