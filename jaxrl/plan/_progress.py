"""Progress lines of ``jaxrl plan`` on stderr: each phase and each compile says what it does and how
long the plan has run, and anything that runs longer than a minute (a real-shape train step compiles
for minutes on a CPU) says so again every minute, so a plan is never silent for long."""

from __future__ import annotations

import contextlib
import sys
import threading
import time


class Progress:
  """``say`` prints ``plan [  12 s] <message>`` (seconds since the plan started) to stderr when enabled;
  ``running`` adds a line every ``every`` seconds while its block runs."""

  def __init__(self, enabled: bool = True, *, every: float = 60.0):
    self.enabled = enabled
    self.every = every
    self.t0 = time.perf_counter()
    self._lock = threading.Lock()

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def say(self, message: str) -> None:
    if not self.enabled:
      return
    with self._lock:  # the heartbeat thread and the main thread never interleave a line
      print(f"plan [{self.elapsed():5.0f} s] {message}", file=sys.stderr, flush=True)

  @contextlib.contextmanager
  def running(self, what: str, *, announce: bool = True):
    """Says ``what`` when the block starts (unless ``announce`` is False), then ``still running (N s):
    <what>`` with the block's own elapsed time every ``every`` seconds until it ends (XLA releases the GIL while it
    compiles, so the heartbeat thread runs during a compile)."""
    if announce:
      self.say(what)
    if not self.enabled or self.every <= 0:
      yield
      return
    stop = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
      while not stop.wait(self.every):
        self.say(f"  still running ({time.perf_counter() - start:.0f} s): {what}")

    thread = threading.Thread(target=beat, name="plan-progress", daemon=True)
    thread.start()
    try:
      yield
    finally:
      stop.set()
      thread.join()


QUIET = Progress(enabled=False)
