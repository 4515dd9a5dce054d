"""Numeric guards on the host side of the train step: count skipped updates, name the non-finite
micro-batches, abort after too many skips in a row.

``make_train_step`` already skips an update whose loss or gradient norm is not finite (parameters and
optimizer state unchanged, ``state.skipped`` + 1) and reports ``mb/nonfinite``: for each micro-batch
``m`` (rows ``m, m + M, m + 2M, ...`` of the global batch), 1 when its loss or its gradient holds a
NaN or an infinity. :class:`SkipGuard` turns those flags into log lines and the abort.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
  """The ``guards:`` section of the SFT and RL configs (docs/reliability.md)."""

  max_consecutive_skips: int = 10
  ("Abort (NonFiniteError) after this many updates in a row were skipped for a non-finite loss or "
   "gradient; 0 never aborts.")

  def __post_init__(self):
    if self.max_consecutive_skips < 0:
      raise ValueError(f"guards.max_consecutive_skips must be >= 0, got {self.max_consecutive_skips}")


class NonFiniteError(RuntimeError):
  """Too many consecutive updates were skipped for a non-finite loss or gradient."""


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

  def observe(self, step: int, skipped: int | float, nonfinite=None, *, what: str = "update") -> None:
    """Records one update of ``step``: ``skipped`` is the step's 0/1 flag, ``nonfinite`` the
    ``mb/nonfinite`` vector (host values)."""
    if not skipped:
      self.consecutive = 0
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

  def state(self) -> dict[str, int]:
    return {"consecutive": self.consecutive}

  def set_state(self, state: dict[str, int] | None) -> None:
    self.consecutive = int((state or {}).get("consecutive", 0))
