"""Progress bar, TensorBoard event files, a JSONL log, a PNG plot and an end-of-run summary table."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


SUMMARY_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward / held-out accuracy", ("reward/mean", "eval/accuracy")),
    ("response length / truncated", ("response/length_mean", "response/truncated_frac")),
    ("KL / entropy", ("kl", "entropy")),
    ("clip fraction", ("clip_frac",)),
    ("throughput (tokens/s)", ("tok_s/rollout", "tok_s/train")),
    ("loss / held-out loss", ("loss", "eval/loss")),
    ("learning rate", ("lr",)),
    ("throughput (tokens/s)", ("tok/s",)),
)
"""The panels of ``curves.png``: ``(title, metrics)``; the first metric on the left axis, the second
(on another scale) on the right. Panels with none of their metrics logged are left out."""


class MetricsLogger:
  """Logs scalar metrics per step to TensorBoard + ``metrics.jsonl`` and shows live progress.

  ``log(step, metrics)`` takes host floats. ``close()`` writes ``curves.png`` (the few curves a
  user watches, :data:`SUMMARY_PANELS`), ``curves_all.png`` (one panel per metric) and prints a
  table of the first/last/min/max of each metric.
  """

  def __init__(self, out_dir: str | Path, *, total_steps: int, desc: str = "train",
               show: tuple[str, ...] = ("loss",), console: Console | None = None, tensorboard: bool = True):
    self.out_dir = Path(out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.total_steps = total_steps
    self.show = show
    self.console = console or Console(stderr=True)
    self.history: dict[str, list[tuple[int, float]]] = {}
    self._jsonl = open(self.out_dir / "metrics.jsonl", "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.out_dir / "tb"))
    self._progress = Progress(
        TextColumn(f"[bold]{desc}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=False)
    self._task = self._progress.add_task(desc, total=total_steps, info="")
    self._desc = desc
    self._live = self.console.is_terminal
    if self._live:
      self._progress.start()
    self._start = time.perf_counter()
    self._last_line = -math.inf
    self._first_step: int | None = None
    self._first_done: float | None = None  # when the first step (>= 1) was logged
    self.first_step_s = self.steady_step_s = math.nan  # compilation included / mean of the later steps

  def log(self, step: int, metrics: dict[str, float]) -> None:
    clean = {k: float(v) for k, v in metrics.items()}
    for k, v in clean.items():
      self.history.setdefault(k, []).append((step, v))
      if self._tb is not None and math.isfinite(v):
        self._tb.add_scalar(k, v, step)
    self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
    self._jsonl.flush()
    info = "  ".join(f"{k}={format_metric(k, clean[k])}" for k in self.show if k in clean)
    info += self._step_times(step)
    self._progress.update(self._task, completed=step, info=info)
    if not self._live:
      self._plain_progress(step, info)

  def _step_times(self, step: int) -> str:
    """First step (compilation included) and steady-state seconds per step, kept apart."""
    if step < 1:
      return ""
    now = time.perf_counter()
    if self._first_done is None:
      self._first_done, self._first_logged = now, step
      self.first_step_s = now - self._start
    done = step - self._first_logged
    self.steady_step_s = (now - self._first_done) / done if done > 0 else math.nan
    steady = f"  {self.steady_step_s:.2f}s/step" if done > 0 else ""
    return f"  first {self.first_step_s:.1f}s{steady}"

  def _plain_progress(self, step: int, info: str) -> None:
    """Without a terminal (CI logs, ``nohup``) rich draws nothing until the end: print a line every
    ~10 s and at the last step instead, with step, the shown metrics, elapsed time and ETA."""
    now = time.perf_counter()
    if self._first_step is None:
      self._first_step, self._first_time = step, now
    if now - self._last_line < 10.0 and step < self.total_steps:
      return
    self._last_line = now
    elapsed = now - self._start
    done = step - self._first_step
    eta = (now - self._first_time) / done * (self.total_steps - step) if done > 0 else math.nan
    eta_txt = "?" if not math.isfinite(eta) else f"{eta:.0f}s"
    self.console.print(f"{self._desc} {step}/{self.total_steps}  {info}  elapsed {elapsed:.0f}s  eta {eta_txt}",
                       highlight=False, soft_wrap=True)

  def note(self, text: str) -> None:
    self._progress.console.print(text)

  def close(self, title: str = "summary") -> Path | None:
    if self._live:
      self._progress.stop()
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    plot = self.plot()
    times = "" if self._first_done is None else f", first step {self.first_step_s:.1f} s"
    if math.isfinite(self.steady_step_s):
      times += f", then {self.steady_step_s:.2f} s/step"
    table = Table(title=f"{title} ({time.perf_counter() - self._start:.1f} s{times})")
    for col in ("metric", "first", "last", "min", "max"):
      table.add_column(col, justify="right" if col != "metric" else "left")
    for k, series in self.history.items():
      vals = [v for _, v in series]
      table.add_row(k, *(format_metric(k, v) for v in (vals[0], vals[-1], min(vals), max(vals))))
    self.console.print(table)
    return plot

  def plot(self) -> Path | None:
    """Writes ``curves_all.png`` (every metric) and ``curves.png`` (:data:`SUMMARY_PANELS`, or every
    metric when none of them was logged); returns the path of ``curves.png``."""
    if not self.history:
      return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    self._draw(plt, tuple((k, (k,)) for k in self.history), self.out_dir / "curves_all.png")
    return self._draw(plt, self.summary_panels(), self.out_dir / "curves.png")

  def summary_panels(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The panels of ``curves.png``: :data:`SUMMARY_PANELS` with a logged metric, else one per metric."""
    panels = tuple((title, tuple(k for k in keys if k in self.history)) for title, keys in SUMMARY_PANELS)
    return tuple((t, keys) for t, keys in panels if keys) or tuple((k, (k,)) for k in self.history)

  def _draw(self, plt, panels: tuple[tuple[str, tuple[str, ...]], ...], path: Path) -> Path:
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
      logged = [k for k in keys if k in self.history]  # summary panels hold logged metrics only
      lines = []
      for i, k in enumerate(logged):
        target = ax if i == 0 else ax.twinx()
        steps, vals = zip(*self.history[k])
        lines += target.plot(steps, vals, marker="." if len(steps) < 50 else None, color=f"C{i}", label=k)
      ax.set_title(title)
      ax.set_xlabel("step")
      if len(logged) > 1:
        ax.legend(lines, logged, fontsize="small", loc="best")
    for ax in list(axes.flat)[len(panels):]:
      ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


RATES = ("tok/s", "tok_s/")
"""Metric-name prefixes of throughputs, shown as whole numbers with thousands separators."""


def format_metric(name: str, v: Any) -> str:
  """``v`` as a person reads it in a progress line or the summary table: a throughput (a name in
  :data:`RATES`) as a whole number (``tok_s/rollout=29,810``), any other float to 4 significant digits
  (``loss=1.235``, ``lr=1.000e-05``), anything else as ``str``."""
  if not isinstance(v, float) or not math.isfinite(v):
    return str(v)
  if name.startswith(RATES):
    return f"{v:,.0f}"
  if v == 0:
    return "0"
  if not 1e-3 <= abs(v) < 1e4:
    return f"{v:.3e}"
  return f"{v:.{max(0, 3 - math.floor(math.log10(abs(v))))}f}"
