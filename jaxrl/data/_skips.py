"""The end-of-run skip report: every input the run did not train on as given, counted by reason.

Sources skip bad records within ``max_bad_records`` (SFT), packing truncates or drops over-long samples
(``packing.overlong``), RL skips prompts longer than ``data.max_prompt_tokens``. :class:`SkipReport`
gathers them: a count per reason and the first few ``file:line`` examples. The trainers print it under
the summary table and write :meth:`SkipReport.as_dict` to ``results.json`` as ``skips``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MAX_EXAMPLES = 3
"""``file:line`` examples kept per reason."""


class SkipReport:
  """Counts per reason, with the first :data:`MAX_EXAMPLES` locations of each."""

  def __init__(self):
    self.counts: dict[str, int] = {}
    self.examples: dict[str, list[str]] = {}

  def add(self, reason: str, where: str | None = None, count: int = 1, *, examples: Iterable[str] = ()) -> None:
    """Records ``count`` skipped inputs for ``reason`` (``where``: their ``file:line``, if known;
    ``examples``: more such locations, for a count of several)."""
    if count <= 0:
      return
    self.counts[reason] = self.counts.get(reason, 0) + count
    listed = self.examples.setdefault(reason, [])
    for w in ([] if where is None else [where]) + list(examples):
      if len(listed) < MAX_EXAMPLES:
        listed.append(w)

  def add_bad_records(self, items: Iterable[tuple[str, str, str]]) -> None:
    """Adds a source's ``bad_reasons`` (``(file:line, reason, message)`` triples)."""
    for where, reason, _ in items:
      self.add(reason, where)

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def as_dict(self) -> dict[str, Any]:
    """``{"total": N, "reasons": {reason: {"count": n, "examples": [file:line, ...]}}}``."""
    return {"total": self.total,
            "reasons": {r: {"count": n, "examples": list(self.examples.get(r, []))}
                        for r, n in sorted(self.counts.items())}}

  def lines(self) -> list[str]:
    """One line per reason (empty when nothing was skipped)."""
    out = []
    for reason, n in sorted(self.counts.items()):
      ex = self.examples.get(reason) or []
      more = " ..." if ex and n > len(ex) else ""
      out.append(f"{reason}: {n}" + (f" (e.g. {', '.join(ex)}{more})" if ex else ""))
    return out

  def print(self, console=None, *, title: str = "skipped inputs") -> None:
    """Prints the report under the summary table: a title line, then one line per reason (whole
    ``file:line`` examples, never cut to the terminal width)."""
    if console is None:
      from rich.console import Console  # pylint: disable=import-outside-toplevel
      console = Console(stderr=True)
    if not self.counts:
      console.print(f"{title}: none", highlight=False)
      return
    console.print(f"{title} ({self.total}):", highlight=False)
    for line in self.lines():
      console.print(f"  {line}", highlight=False, soft_wrap=True, markup=False)
