"""Numeric guards on the host side of the train step: count skipped updates, name the non-finite
micro-batches, abort after too many skips in a row; optionally flag loss spikes.

``make_train_step`` already skips an update whose loss or gradient norm is not finite (parameters and
optimizer state unchanged, ``state.skipped`` + 1) and reports ``mb/nonfinite``: for each micro-batch
``m`` (rows ``m, m + M, m + 2M, ...`` of the global batch), 1 when its loss or its gradient holds a
NaN or an infinity. :class:`SkipGuard` turns those flags into log lines and the abort.

Loss spikes (``guards.spike_window`` > 0): a finite loss above ``median + spike_threshold × 1.4826 ×
MAD`` of the previous ``spike_window`` finite losses (MAD: median absolute deviation, scaled to a
normal standard deviation; floored at 1e-3 × |median| so that a flat curve does not make every
wiggle a spike) is a spike. It is logged and counted (``warn``) or stops the run with
:class:`LossSpikeError` (``abort``). The update has already been applied when the host sees the loss,
so a spike is never silently skipped: ``abort`` leaves the last checkpoint before it to resume from
with another learning rate or data order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
  """The ``guards:`` section of the SFT and RL configs (docs/reliability.md)."""

  max_consecutive_skips: int = 10
  ("Abort (NonFiniteError) after this many updates in a row were skipped for a non-finite loss or "
   "gradient; 0 never aborts.")

  spike_window: int = 0
  "Loss-spike detection over the previous this-many finite losses (0: off; at least 4 when on)."
  spike_threshold: float = 6.0
  "A loss above median + spike_threshold × (1.4826 × MAD) of the window is a spike."
  spike_action: Literal["warn", "abort"] = "warn"
  "warn: log and count the spike; abort: stop with LossSpikeError (the last checkpoint predates it)."

  def __post_init__(self):
    if self.max_consecutive_skips < 0:
      raise ValueError(f"guards.max_consecutive_skips must be >= 0, got {self.max_consecutive_skips}")
    if self.spike_window < 0 or 0 < self.spike_window < 4:
      raise ValueError(f"guards.spike_window must be 0 (off) or >= 4, got {self.spike_window}")
    if not self.spike_threshold > 0:
      raise ValueError(f"guards.spike_threshold must be > 0, got {self.spike_threshold}")
    if self.spike_action not in ("warn", "abort"):
      raise ValueError(f"guards.spike_action must be 'warn' or 'abort', got {self.spike_action!r}")


class NonFiniteError(RuntimeError):
  """Too many consecutive updates were skipped for a non-finite loss or gradient."""


class LossSpikeError(RuntimeError):
  """A loss spike with ``guards.spike_action: abort``."""


def spike_limit(window, threshold: float) -> float:
  """The largest loss that is not a spike after the losses ``window``: median + threshold × σ̂,
  σ̂ = max(1.4826 × MAD, 1e-3 × |median|, 1e-12)."""
  x = np.asarray(window, np.float64)
  med = float(np.median(x))
  sigma = max(1.4826 * float(np.median(np.abs(x - med))), 1e-3 * abs(med), 1e-12)
  return med + threshold * sigma


class SkipGuard:
  """Follows skipped updates: logs each (with the non-finite micro-batch ids) and raises
  :class:`NonFiniteError` after ``max_consecutive_skips`` in a row.

  ``consecutive`` is part of the trainers' checkpointed host state, so a resumed run aborts where
  the uninterrupted one would.
  """

  def __init__(self, cfg: GuardConfig, log: Callable[[str], None]):
    self.cfg, self.log = cfg, log
    self.consecutive = 0
    self.total = 0
    self.losses: list[float] = []  # the last spike_window finite losses
    self.spikes = 0

  def observe(self, step: int, skipped: int | float, nonfinite=None, loss=None, *, what: str = "update") -> None:
    """Records one update of ``step``: ``skipped`` is the step's 0/1 flag, ``nonfinite`` the
    ``mb/nonfinite`` vector, ``loss`` its loss (host values; ``None``: no spike check)."""
    if not skipped:
      self.consecutive = 0
      if loss is not None:
        self._check_spike(step, float(np.asarray(loss)), what)
      return
    self.consecutive += 1
    self.total += 1
    ids = [] if nonfinite is None else np.flatnonzero(np.asarray(nonfinite).reshape(-1)).tolist()
    where = f" in micro-batch(es) {ids}" if ids else ""
    self.log(f"step {step}: non-finite loss or gradient{where}; {what} skipped "
             f"({self.consecutive} in a row, {self.total} in this run)")
    limit = self.cfg.max_consecutive_skips
    if limit and self.consecutive >= limit:
      raise NonFiniteError(
          f"step {step}: {self.consecutive} consecutive {what}s skipped for a non-finite loss or gradient "
          f"(guards.max_consecutive_skips={limit}); the parameters are those of the last finite update. "
          "Check the data of these steps, lower optim.lr, or raise the limit")

  def _check_spike(self, step: int, loss: float, what: str) -> None:
    window = self.cfg.spike_window
    if not window or not np.isfinite(loss):
      return
    if len(self.losses) == window:
      limit = spike_limit(self.losses, self.cfg.spike_threshold)
      if loss > limit:
        self.spikes += 1
        msg = (f"step {step}: loss spike: {loss:.6g} > {limit:.6g} (median + guards.spike_threshold="
               f"{self.cfg.spike_threshold:g} x MAD-sigma of the last {window} {what}s)")
        if self.cfg.spike_action == "abort":
          raise LossSpikeError(f"{msg}; stopping (guards.spike_action=abort). Resume from the last "
                               "checkpoint with a lower optim.lr, or set guards.spike_action=warn")
        self.log(f"{msg}; {self.spikes} in this run")
    self.losses = (self.losses + [loss])[-window:]

  def state(self) -> dict:
    return {"consecutive": self.consecutive, "losses": list(self.losses), "spikes": self.spikes}

  def set_state(self, state: dict | None) -> None:
    state = state or {}
    self.consecutive = int(state.get("consecutive", 0))
    self.losses = [float(x) for x in state.get("losses", [])][-self.cfg.spike_window:] if self.cfg.spike_window else []
    self.spikes = int(state.get("spikes", 0))
