"""Pre-emption: SIGTERM / SIGINT ask the trainer to stop after the current step with a checkpoint.

A pre-empted run raises :class:`Preempted` once the final checkpoint has committed; ``jaxrl sft`` and
``jaxrl rl`` then exit with ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), the shell's convention
for a process ended by a signal, so a scheduler requeues it and the next launch continues with
``checkpoint.resume=auto``. A second SIGINT while the step finishes interrupts at once (Ctrl-C twice).
"""

from __future__ import annotations

import signal
import threading

import numpy as np

from jaxrl import sharding


class Preempted(Exception):
  """The run stopped on a signal after checkpointing ``step``; ``exit_code`` is ``128 + signum``."""

  def __init__(self, signum: int, step: int, checkpointed: bool):
    self.signum, self.step, self.checkpointed = signum, step, checkpointed
    self.exit_code = 128 + signum
    saved = f"checkpoint of step {step} written" if checkpointed else "no checkpoint (checkpoint.every=0)"
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {saved}; "
                     f"exit status {self.exit_code}")


class PreemptionGuard:
  """Context manager that turns SIGTERM / SIGINT into a flag the training loop polls.

  Handlers are installed only from the main thread (Python's rule) and the previous ones come back on
  exit. :meth:`requested` is collective on several processes: a signal seen by any process stops
  every process after the same step (one tiny all-gather per call).
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame):
    if self.signum == signal.SIGINT and signum == signal.SIGINT:
      raise KeyboardInterrupt  # the second Ctrl-C does not wait for the step
    self.signum = signum

  def install(self) -> "PreemptionGuard":
    """Installs the handlers (main thread only; elsewhere a no-op) and clears the flag."""
    self.signum = None
    if not self._previous and threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def uninstall(self) -> None:
    """Puts the previous handlers back; calling it again does nothing."""
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()

  def __enter__(self) -> "PreemptionGuard":
    return self.install()

  def __exit__(self, *exc) -> None:
    self.uninstall()

  def requested(self) -> int | None:
    """The signal that asked to stop (any process's), or ``None``."""
    mine = int(np.max(sharding.allgather_scalar(self.signum or 0)))
    return mine or None
